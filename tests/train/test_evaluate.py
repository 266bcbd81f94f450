import math

import numpy as np
import pytest
import torch

from kiln.train.evaluate import evaluate, unigram_bpb


def test_bits_per_byte_is_nats_over_ln2_bytes_and_skips_zero_byte_targets():
    byte_lengths = torch.tensor([0, 1, 2, 3])  # token 0 is special: no bytes
    y = torch.tensor([[1, 2, 0, 3]])
    seen = []

    def loss_fn(x, targets):
        seen.append(targets.clone())
        return torch.tensor(6.0)  # pretend 6 nats over the kept targets

    out = evaluate(loss_fn, [(y, y)], byte_lengths, torch.device("cpu"))
    assert seen[0].tolist() == [[1, 2, -100, 3]]
    assert out["val_tokens"] == 3
    assert out["val_loss"] == pytest.approx(2.0)
    assert out["val_bpb"] == pytest.approx(6.0 / (math.log(2) * 6))


def test_unigram_bpb_matches_a_hand_computation():
    byte_lengths = torch.tensor([0, 1, 2])
    train = np.array([1, 1, 2, 0])
    val = np.array([1, 2, 0])
    counts = np.array([1, 2, 1]) + 1.0
    p = counts / counts.sum()
    expected = -(math.log(p[1]) + math.log(p[2])) / (math.log(2) * 3)
    assert unigram_bpb([train], val, byte_lengths) == pytest.approx(expected)
    assert unigram_bpb([train[:1], train[1:]], val, byte_lengths) == pytest.approx(expected)  # shard by shard
