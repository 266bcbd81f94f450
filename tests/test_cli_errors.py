"""Bad input to the `kiln` command: exit status 2, one `kiln: error:` line naming the problem and the fix,
no traceback; and the CLI basics (`--version`, `python -m kiln`, `kiln run --help`).

Every case goes through the real entry point, kiln.cli.main, and stops before any training.
"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import kiln
from kiln.cli import main

STDLIB = Path(os.__file__).parent


def kiln_error(capsys, argv: list[str]) -> str:
    """Run `kiln argv`; assert exit status 2 and one clean error line; return that line."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kiln: error: "), err
    return lines[0]


def text_file(path: Path, n_bytes: int) -> Path:
    """A UTF-8 text file of about n_bytes with blank-line paragraphs (the stdlib's argparse source)."""
    text = (STDLIB / "argparse.py").read_text(encoding="utf-8")
    while len(text) < n_bytes:
        text += text
    path.write_text(text[:n_bytes], encoding="utf-8")
    return path


RUN = ["run", "--preset", "tiny", "--device", "cpu", "--no-progress"]


# ---- kiln run: config ------------------------------------------------------------------------------------
def test_section_given_a_value(capsys, tmp_path):
    msg = kiln_error(capsys, RUN + ["--out", str(tmp_path / "r"), "--model=3"])
    assert "config.model is a section" in msg and "--model.KEY=VALUE" in msg


@pytest.mark.parametrize(
    "content, expect",
    [
        (b"[1, 2]", "holds an array, not a JSON object"),
        (b'"train"', "holds a string, not a JSON object"),
        (b'\xff\xfe{"train": {}}', "is not UTF-8 text"),
        (b'{"train": {"steps": }', "is not valid JSON"),
        (None, "is a directory, not a file"),
    ],
)
def test_bad_config_file(capsys, tmp_path, content, expect):
    cfg = tmp_path / "cfg.json"
    if content is None:
        cfg.mkdir()
    else:
        cfg.write_bytes(content)
    msg = kiln_error(capsys, RUN + ["--out", str(tmp_path / "r"), "--config", str(cfg)])
    assert str(cfg) in msg and expect in msg


@pytest.mark.parametrize(
    "override, expect",
    [
        ("--train.beta1=1.5", "train.beta1 must be in [0, 1), got 1.5"),
        ("--train.beta2=-0.1", "train.beta2 must be in [0, 1)"),
        ("--train.eps=0", "train.eps must be positive"),
        ("--train.weight_decay=-5", "train.weight_decay must be >= 0, got -5"),
        ("--train.keep_checkpoints=-1", "train.keep_checkpoints must be >= 0 (0 keeps every checkpoint)"),
        ("--train.lr=inf", "train.lr must be a finite number"),
        ("--sample.top_k=-2", "sample.top_k must be >= 1"),
        ("--sample.temperature=nan", "sample.temperature must be >= 0 and finite"),
    ],
)
def test_bad_train_values_are_refused_before_data_preparation(capsys, tmp_path, override, expect):
    out = tmp_path / "r"
    # a corpus that would take a while to prepare: the error must come first
    msg = kiln_error(capsys, RUN + ["--out", str(out), "--data", str(STDLIB), override])
    assert expect in msg
    assert not out.exists()  # nothing written: the run never started


def test_override_without_value_names_only_the_users_argument(capsys, tmp_path):
    msg = kiln_error(capsys, RUN + ["--train.steps", "--out", str(tmp_path / "r")])
    assert msg == "kiln: error: override --train.steps has no value: write --train.steps=VALUE"
    msg = kiln_error(capsys, RUN + ["--out", str(tmp_path / "r"), "--train.steps"])
    assert "out_dir" not in msg and "--train.steps=VALUE" in msg


def test_out_is_an_existing_file(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    msg = kiln_error(capsys, RUN + ["--out", str(f)])
    assert "is an existing file, not a directory" in msg
    assert f.read_text() == "x"


def test_stop_at_negative(capsys, tmp_path):
    msg = kiln_error(capsys, RUN + ["--out", str(tmp_path / "r"), "--stop-at", "-1"])
    assert "--stop-at must be a step number >= 0" in msg


# ---- kiln run: data ----------------------------------------------------------------------------------------
def test_missing_data_path_before_the_run_directory_is_made(capsys, tmp_path):
    msg = kiln_error(capsys, RUN + ["--out", str(tmp_path / "r"), "--data", str(tmp_path / "nope.txt")])
    assert "does not exist" in msg and "--data PATH" in msg
    assert not (tmp_path / "r").exists()


def test_parquet_text_column_of_ints(capsys, tmp_path):
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), data)
    msg = kiln_error(capsys, RUN + ["--out", str(tmp_path / "r"), "--data", str(data)])
    assert "'text' column holds int64, not strings" in msg


def test_single_file_too_small_for_a_split(capsys, tmp_path):
    data = text_file(tmp_path / "small.txt", 1500)
    msg = kiln_error(capsys, RUN + ["--out", str(tmp_path / "r"), "--data", str(data)])
    assert "too little data" in msg and "1 document(s)" in msg and "more than 2 KB" in msg


def test_single_file_whose_validation_split_is_too_small(capsys, tmp_path):
    # 12 KB: six documents of 2 KB; one goes to validation, about 1k tokens, less than one 32 x 64 batch
    data = text_file(tmp_path / "c.txt", 12_000)
    argv = RUN + ["--out", str(tmp_path / "r"), "--data", str(data), "--train.batch_size=32"]
    msg = kiln_error(capsys, argv + ["--tokenizer.vocab_size=300"])
    assert "too little data: the validation split has" in msg and "raise data.val_fraction" in msg


def test_single_file_that_is_not_utf8(capsys, tmp_path):
    data = tmp_path / "latin1.txt"
    data.write_bytes("café crème\n".encode("latin-1") * 500)
    msg = kiln_error(capsys, RUN + ["--out", str(tmp_path / "r"), "--data", str(data)])
    assert "is not UTF-8 text" in msg and "iconv" in msg


def test_directory_of_only_binary_files(capsys, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_bytes(b"\x00\x01\x02" * 100)
    (d / "b.txt").write_bytes("é".encode("latin-1") * 100)
    rc = main(RUN + ["--out", str(tmp_path / "r"), "--data", str(d)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "kiln: note: skipped 2 file(s)" in err
    assert "kiln: error: no text found in" in err and "binary or not UTF-8" in err


# ---- kiln generate: sampling arguments (checked before anything is loaded) ----------------------------------
@pytest.mark.parametrize(
    "args, expect",
    [
        (["--temperature", "-1"], "temperature (--temperature) must be a finite number >= 0"),
        (["--temperature", "nan"], "temperature (--temperature) must be a finite number >= 0"),
        (["--temperature", "inf"], "temperature (--temperature) must be a finite number >= 0"),
        (["--max-new-tokens", "-5"], "max_new_tokens (--max-new-tokens) must be >= 0, got -5"),
        (["--top-p", "0"], "top_p (--top-p) must be in (0, 1]"),
        (["--top-p", "-0.5"], "top_p (--top-p) must be in (0, 1]"),
        (["--top-p", "1.5"], "top_p (--top-p) must be in (0, 1]"),
        (["--top-p", "nan"], "top_p (--top-p) must be in (0, 1]"),
        (["--top-k", "-3"], "top_k (--top-k) must be >= 1, or 0 to turn it off"),
        (["--n", "0"], "n (--n) is the number of samples and must be >= 1"),
    ],
)
def test_generate_refuses_out_of_range_sampling(capsys, tmp_path, args, expect):
    msg = kiln_error(capsys, ["generate", "--checkpoint", str(tmp_path)] + args)
    assert expect in msg


def test_generate_missing_checkpoint(capsys, tmp_path):
    msg = kiln_error(capsys, ["generate", "--checkpoint", str(tmp_path / "nope")])
    assert "does not exist" in msg and "kiln convert" in msg
    (tmp_path / "notes.txt").write_text("not a model")
    msg = kiln_error(capsys, ["generate", "--checkpoint", str(tmp_path)])
    assert "is not a model" in msg and "kiln model directory" in msg


@pytest.mark.parametrize(
    "argv",
    [["convert", "{src}", "{out}"], ["quantize", "--model", "{src}", "--scheme", "int8", "--out", "{out}"]],
)
def test_model_source_that_does_not_exist_or_holds_no_weights(capsys, tmp_path, argv):
    # a path that is not there is named as such; a file that is there but holds no weights lists the forms
    fill = lambda src: [a.format(src=src, out=tmp_path / "out") for a in argv]  # noqa: E731
    msg = kiln_error(capsys, fill(tmp_path / "nope"))
    assert "nope does not exist" in msg
    (tmp_path / "notes.txt").write_text("not a model")
    msg = kiln_error(capsys, fill(tmp_path / "notes.txt"))
    assert "holds no weights kiln can read" in msg


# ---- kiln tokenizer ----------------------------------------------------------------------------------------
@pytest.fixture
def corpus_dir(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    text_file(d / "a.txt", 4000)
    return d


@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--processes", "0"], "--processes must be >= 1"),
        (["--min-frequency", "-3"], "--min-frequency must be >= 1"),
    ],
)
def test_tokenizer_train_bad_numbers(capsys, tmp_path, corpus_dir, flags, expect):
    msg = kiln_error(capsys, ["tokenizer", "train", str(corpus_dir), "--out", str(tmp_path / "t")] + flags)
    assert expect in msg


def test_tokenizer_outputs_that_exist(capsys, tmp_path, corpus_dir):
    f = tmp_path / "file"
    f.write_text("keep me")
    msg = kiln_error(capsys, ["tokenizer", "train", str(corpus_dir), "--out", str(f)])
    assert "is an existing file, not a directory" in msg
    msg = kiln_error(capsys, ["tokenizer", "train", str(corpus_dir), "--out", str(f / "sub")])
    assert f"{f} is a file, not a directory" in msg

    tok = tmp_path / "tok"
    argv = [
        "tokenizer",
        "train",
        str(corpus_dir),
        "--out",
        str(tok),
        "--vocab-size",
        "270",
        "--processes",
        "1",
    ]
    assert main(argv) == 0
    capsys.readouterr()
    before = (tok / "tokenizer.json").read_bytes()
    msg = kiln_error(capsys, argv)  # a second training into the same directory
    assert "already holds a tokenizer" in msg and "--force" in msg

    convert = ["tokenizer", "convert", str(tok)]
    msg = kiln_error(capsys, convert + ["--to", "hf", "--out", str(f)])
    assert "is an existing file, not a directory" in msg
    msg = kiln_error(capsys, convert + ["--to", "tiktoken", "--out", str(tmp_path)])
    assert "is a directory, but --to tiktoken writes one file" in msg
    msg = kiln_error(capsys, convert + ["--to", "tiktoken", "--out", str(f)])
    assert "already exists" in msg and "--force" in msg
    msg = kiln_error(capsys, convert + ["--to", "hf", "--out", str(tok)])
    assert "already holds a tokenizer" in msg
    assert f.read_text() == "keep me" and (tok / "tokenizer.json").read_bytes() == before
    assert main(convert + ["--to", "tiktoken", "--out", str(f), "--force"]) == 0


# ---- the CLI basics ----------------------------------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kiln {kiln.__version__}"


@pytest.mark.slow  # a fresh interpreter imports torch: 5-15 s on a busy 2-core machine
def test_python_dash_m_kiln():
    src = str(Path(kiln.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [sys.executable, "-m", "kiln", "--version"], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == f"kiln {kiln.__version__}", r.stderr


def test_run_help_lists_config_sections_and_presets(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for line in (
        "data:      path, max_bytes",
        "tokenizer: vocab_size",
        "model:     arch",
        "train:     steps",
    ):
        assert line in out
    assert "sample:    prompts" in out and "keep_checkpoints" in out and "out_dir, device" in out
    assert "presets: cpu, gpu, tiny, speedrun" in out and "configs/{cpu,gpu,tiny,speedrun}.json" in out
    assert "split into documents at blank lines" in out  # --data says what a text file becomes


def test_run_help_keys_match_the_config():
    from kiln.train.cli import config_help
    from kiln.train.config import RunConfig

    text = config_help(width=10_000)
    for f in dataclasses.fields(RunConfig):
        if dataclasses.is_dataclass(f.default_factory):
            keys = [g.name for g in dataclasses.fields(f.default_factory)]
            assert f"  {f.name + ':':<11}" + ", ".join(keys) in text


def test_tokenizer_train_skips_binary_files_with_a_note(capsys, tmp_path, corpus_dir):
    (corpus_dir / "blob").write_bytes(b"\x7fELF\x00\x00\x00")  # valid UTF-8, but binary
    (corpus_dir / "latin1.txt").write_bytes("café".encode("latin-1"))
    argv = ["tokenizer", "train", str(corpus_dir), "--out", str(tmp_path / "t"), "--vocab-size", "270"]
    assert main(argv + ["--processes", "1"]) == 0
    err = capsys.readouterr().err
    assert "kiln: note: skipped 2 file(s) that are binary or not UTF-8 text" in err
