"""Corpora, token shards and the data loader."""
