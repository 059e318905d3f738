"""`anygrad eval` and `anygrad predict` on a run trained with `--dataset tokens`: eval reads the
run's own token file, split as training split it (the same held-out tokens, or the folder's
val.bin), and reports the loss and perplexity training logged; predict says it does not predict
from a language model and what to use instead."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from anygrad import cli
from anygrad.cli import predict

torch = pytest.importorskip("torch")
VOCAB, T = 16, 6


class TinyLM(torch.nn.Module):
    """(B, T) token ids -> (B, T, VOCAB) next-token logits: embedding, a causal mean of the past, a head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype).reshape(1, -1, 1)
        return self.head(torch.cumsum(h, dim=1) / steps)


def _lm(path: Path) -> Path:
    import anygrad
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        anygrad.from_torch(TinyLM(), torch.zeros(2, T, dtype=torch.int64), dynamo=False, path=path)
    return path


def _train(tmp_path: Path, data: Path, *flags: str) -> Path:
    run = tmp_path / "run"
    code = cli.main(["train", str(_lm(tmp_path / "lm.onnx")), "--dataset", "tokens", "--data-dir", str(data),
                     "--block-size", str(T), "--batch-size", "4", "--epochs", "1", "--device", "cpu",
                     "--optimizer", "sgd", "--lr", "0.1", "--artifacts", str(run), "--quiet", *flags])
    assert code == 0
    return run


def _eval_metrics(out: str) -> dict[str, float]:
    line = next(ln for ln in out.splitlines() if ln.startswith("loss "))
    words = line.split()
    return {"loss": float(words[1]), "perplexity": float(words[words.index("perplexity") + 1])}


def test_eval_a_token_run_on_its_own_validation_split(tmp_path, capsys, monkeypatch):
    tokens = np.random.default_rng(0).integers(0, VOCAB, 300).astype(np.uint16)
    tokens.tofile(tmp_path / "corpus.bin")
    run = _train(tmp_path, tmp_path / "corpus.bin")
    logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    got = _eval_metrics(out)
    # the last 10% of the file (30 tokens), as training held it out: 29 // 6 = 4 windows
    assert "tokens valid, 4 windows of 6 tokens" in out and "last 30 of 300 tokens" in out
    assert got["loss"] == pytest.approx(logged["valid_loss"], abs=1e-4)
    assert got["perplexity"] == pytest.approx(np.exp(logged["valid_loss"]), rel=1e-3)
    if "valid_perplexity" in logged:
        assert got["perplexity"] == pytest.approx(logged["valid_perplexity"], rel=1e-3)

    assert cli.main(["eval", str(run), "--device", "cpu", "--split", "train"]) == 0
    out = capsys.readouterr().out
    assert "tokens train, 44 windows of 6 tokens" in out and "first 270 of 300 tokens" in out  # 269 // 6
    whole = _eval_metrics(out)
    assert np.isfinite(whole["loss"])
    monkeypatch.setattr(predict, "TOKEN_EVAL_BATCHES", 1)  # 44 windows read 3 at a time: the same means
    assert cli.main(["eval", str(run), "--device", "cpu", "--split", "train", "--batch-size", "3"]) == 0
    assert _eval_metrics(capsys.readouterr().out) == pytest.approx(whole, rel=1e-4, abs=1e-4)


def test_eval_a_token_folder_reads_val_bin_and_no_held_out_part_says_use_train(tmp_path, capsys):
    rng = np.random.default_rng(1)
    (tmp_path / "data").mkdir()
    rng.integers(0, VOCAB, 200).astype(np.uint16).tofile(tmp_path / "data" / "train.bin")
    rng.integers(0, VOCAB, 61).astype(np.uint16).tofile(tmp_path / "data" / "val.bin")
    run = _train(tmp_path, tmp_path / "data")
    logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "10 windows" in out and "val.bin" in out  # (61 - 1) // 6
    assert _eval_metrics(out)["loss"] == pytest.approx(logged["valid_loss"], abs=1e-4)

    rng.integers(0, VOCAB, 200).astype(np.uint16).tofile(tmp_path / "flat.bin")
    run = tmp_path / "run0"
    assert cli.main(["train", str(tmp_path / "lm.onnx"), "--dataset", "tokens", "--data-dir",
                     str(tmp_path / "flat.bin"), "--block-size", str(T), "--batch-size", "4", "--epochs", "1",
                     "--device", "cpu", "--valid-fraction", "0", "--artifacts", str(run), "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--device", "cpu"]) == 2
    assert "--split train" in capsys.readouterr().err


def test_predict_on_a_token_run_says_what_to_use_instead(tmp_path, capsys):
    np.random.default_rng(2).integers(0, VOCAB, 120).astype(np.uint16).tofile(tmp_path / "corpus.bin")
    run = _train(tmp_path, tmp_path / "corpus.bin")
    capsys.readouterr()
    assert cli.main(["predict", str(run), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "unknown dataset" not in err
    assert "language model trained on tokens" in err and "anygrad eval" in err and ".predict(ids)" in err
