"""`kiln run --data FILE` on one text file, then `kiln convert` and `kiln generate` on every form of its
model: the run directory, checkpoints/, a .pt file, a kiln model directory and an HF directory give the same
greedy text; the HF directory's tokenizer loads in transformers with kiln's ids."""

import json
import os
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.tokenizer import Tokenizer

STDLIB = Path(os.__file__).parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step run on one 40 KB text file (cut into ~20 documents), with its conversions."""
    root = tmp_path_factory.mktemp("gen")
    data = root / "corpus.txt"
    data.write_text((STDLIB / "argparse.py").read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    out = root / "run"
    argv = ["run", "--preset", "tiny", "--device", "cpu", "--no-progress", "--data", str(data)]
    argv += ["--out", str(out), "--train.steps=2", "--train.eval_batches=1", "--tokenizer.vocab_size=300"]
    assert main(argv + ["--sample.max_new_tokens=0"]) == 0
    assert main(["convert", str(out), str(root / "hf")]) == 0
    assert main(["convert", str(root / "hf"), str(root / "kiln")]) == 0
    return out


def generate(capsys, source, *flags) -> tuple[str, str]:
    argv = ["generate", "--checkpoint", str(source), "--prompt", "def ", "--temperature", "0"]
    assert main(argv + list(flags)) == 0
    out, err = capsys.readouterr()
    return out, err


def test_single_text_file_is_a_corpus(run_dir):
    meta = json.loads((run_dir / "data" / "meta.json").read_text())
    docs = meta["splits"]["train"]["docs"] + meta["splits"]["val"]["docs"]
    assert 10 <= docs <= 20  # 40 KB in documents of 2-8 KB
    assert meta["splits"]["val"]["docs"] >= 1 and meta["splits"]["val"]["tokens"] > 0


def test_every_model_form_generates_the_same_text(capsys, run_dir):
    capsys.readouterr()
    ckpt = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]
    root = run_dir.parent
    first, err = generate(capsys, run_dir, "--max-new-tokens", "12")
    assert first.startswith("def ") and err == ""
    for source in (run_dir / "checkpoints", ckpt, root / "kiln", root / "hf"):
        assert generate(capsys, source, "--max-new-tokens", "12") == (first, ""), source
    # --model, as `kiln serve` and `kiln quantize` name it, is the same argument
    argv = ["generate", "--model", str(root / "hf"), "--prompt", "def ", "--temperature", "0"]
    assert main(argv + ["--max-new-tokens", "12"]) == 0
    assert capsys.readouterr() == (first, "")


def test_convert_writes_the_tokenizer_beside_the_weights(run_dir):
    from transformers import AutoTokenizer

    root = run_dir.parent
    kiln_tok = Tokenizer.load(run_dir / "tokenizer")
    assert {p.name for p in (root / "hf").iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    assert (root / "kiln" / "kiln_tokenizer.json").is_file() and (root / "kiln" / "tokenizer.json").is_file()
    hf_tok = AutoTokenizer.from_pretrained(root / "hf")
    text = (STDLIB / "json" / "decoder.py").read_text(encoding="utf-8") + " naïve café ✓\n\n  x"
    ids = kiln_tok.encode_ordinary(text)
    assert len(ids) > 1000 and hf_tok(text, add_special_tokens=False)["input_ids"] == ids
    assert hf_tok.decode(ids) == text
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.model_max_length == 64  # the model's context
    assert Tokenizer.load(root / "kiln").encode_ordinary(text) == ids


def test_max_new_tokens_past_the_context_is_capped_with_one_note(capsys, run_dir):
    out, err = generate(capsys, run_dir, "--max-new-tokens", "500", "--temperature", "0.8")
    n_prompt = 1 + len(Tokenizer.load(run_dir / "tokenizer").encode_ordinary("def "))  # <|endoftext|> first
    assert err.splitlines() == [
        f"kiln: note: --max-new-tokens 500 capped at {64 - n_prompt}: the model's context is 64 tokens and "
        f"the prompt takes {n_prompt}"
    ]
    assert out.startswith("def ")


def test_generate_names_a_missing_tokenizer(capsys, run_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("model.json", "model.safetensors"):
        (bare / name).write_bytes((run_dir.parent / "kiln" / name).read_bytes())
    assert main(["generate", "--checkpoint", str(bare)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("kiln: error: no tokenizer for") and "tokenizer.json" in err and "Traceback" not in err
    )


def test_prompts_file_batches_through_the_engine(capsys, run_dir, tmp_path):
    # a batch of prompts gives each prompt the text it gets alone (greedy), samples separated by ---
    prompts = ["def ", "class A:", "import os"]
    alone = []
    for p in prompts:
        assert main(["generate", "--checkpoint", str(run_dir), "--prompt", p, "--temperature", "0",
                     "--max-new-tokens", "10", "--no-stream"]) == 0  # fmt: skip
        alone.append(capsys.readouterr().out.rstrip("\n"))
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n\n", encoding="utf-8")
    argv = ["generate", "--checkpoint", str(run_dir), "--prompts-file", str(f), "--temperature", "0"]
    assert main(argv + ["--max-new-tokens", "10"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n").split("\n---\n") == alone and err == ""
    # streamed (the default for one prompt) equals the text printed at the end
    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "def ", "--temperature", "0",
                 "--max-new-tokens", "10"]) == 0  # fmt: skip
    assert capsys.readouterr().out.rstrip("\n") == alone[0]
    # n samples per prompt, seeded: reproducible
    argv = ["generate", "--checkpoint", str(run_dir), "--prompt", "x", "--n", "2", "--seed", "3"]
    assert main(argv + ["--max-new-tokens", "8"]) == 0
    first = capsys.readouterr().out
    assert main(argv + ["--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == first and first.count("\n---\n") == 1


def test_prompts_file_errors(capsys, run_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    for path, msg in (
        (tmp_path / "nope.txt", "does not exist"),
        (empty, "holds no prompt"),
        (tmp_path, "not a UTF-8"),
    ):
        assert main(["generate", "--checkpoint", str(run_dir), "--prompts-file", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kiln: error: --prompts-file") and msg in err and "Traceback" not in err
