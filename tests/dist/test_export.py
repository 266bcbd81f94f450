"""`kiln convert` of a sharded (DCP) checkpoint: the bad cases are one clean error. The export itself is
tested in the parity launch (test_parity.test_sharded_checkpoint_exports_to_one_hf_directory)."""

from kiln.cli import main


def _error(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and err.startswith("kiln: error: "), err
    return err


def test_sharded_checkpoint_without_model_json(capsys, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"")
    err = _error(capsys, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    assert "sharded (DCP) checkpoint without model.json" in err


def test_sharded_checkpoint_of_another_model(capsys, tmp_path):
    # model.json present, shards unreadable: the DCP error, named, not a traceback
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"not a DCP index")
    cfg = '{"arch": "llama", "vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64, "max_seq_len": 16}'
    (tmp_path / "ckpt" / "model.json").write_text(cfg)
    err = _error(capsys, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    assert "the sharded checkpoint does not hold the model" in err
