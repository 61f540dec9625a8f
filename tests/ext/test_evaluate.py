"""`moed eval` measures what it says: KL(reference || model), top-1 agreement and bits per
byte, checked against figures computed here from the reference's own logits."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from daemon.commands.cli import main
from ext.evaluate import EvaluationInputError, log_softmax, token_stream
from ext.makemodel import make_model
from ext.models.model import Model
from ext.tokenizer import Tokenizer

TEXT = ("def parse(argv):\n    parser = ArgumentParser(prog='x')\n    parser.add_argument('--n', "
        "type=int)\n    return parser.parse_args(argv)\n") * 6
CONTEXT = 48


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A make-model checkpoint (f32, one shard) and copies whose lm_head is edited."""
    root = tmp_path_factory.mktemp("eval")
    ref = make_model(root / "ref", arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=64,
                     intermediate=32, dtype="f32", initializer_range=0.2, seed=3)
    (root / "text.txt").write_text(TEXT)

    def edited(name, edit):
        out = root / name
        shutil.copytree(ref, out)
        tensors = load_file(out / "model.safetensors")
        tensors["lm_head.weight"] = edit(tensors["lm_head.weight"])
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return out

    swap = np.arange(64)
    swap[[0, 1]] = [1, 0]
    return {"ref": ref, "text": root / "text.txt",
            "double": edited("double", lambda w: w * np.float32(2)),      # logits x 2, exactly
            "swapped": edited("swapped", lambda w: w[np.r_[swap, 64:w.shape[0]]].copy()),
            "root": root}


def _eval(capsys, model, reference, text, *extra) -> dict:
    assert main(["eval", "--model", str(model), "--reference", str(reference), "--text", str(text),
                 "--context", str(CONTEXT), *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _reference_logits(ref_dir: Path, n_tokens: int | None = None):
    """Teacher-forced logits of every window, computed here window by window, and the ids."""
    tok = Tokenizer.from_model_dir(ref_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    if n_tokens is not None:
        ids = ids[:n_tokens + 1]
    model = Model.load(ref_dir, n_threads=1)
    logits = []
    for s in range(0, len(ids) - 1, CONTEXT):
        window = ids[s:min(s + CONTEXT, len(ids) - 1)]
        logits.append(model.forward(model.new_sequence(len(window)), window, all_logits=True))
    return np.concatenate(logits).astype(np.float64), np.asarray(ids), tok


def _softmax_log(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_a_model_against_itself_has_zero_kl_and_full_agreement(models, capsys):
    out = _eval(capsys, models["ref"], models["ref"], models["text"])
    assert out["kl_mean_nats"] == 0 and out["kl_p99_nats"] == 0 and out["kl_max_nats"] == 0
    assert out["top1_agreement"] == 1.0
    assert out["bits_per_byte"]["model"] == out["bits_per_byte"]["reference"] > 0


def test_doubled_logits_give_the_kl_computed_independently(models, capsys):
    """lm_head x 2 makes the model's logits exactly 2 z: KL(softmax z || softmax 2z) per
    position, top-1 unchanged, and the model's bits per byte from its own nats."""
    z, ids, tok = _reference_logits(models["ref"], 100)
    lp, lq = _softmax_log(z), _softmax_log(2 * z)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    out = _eval(capsys, models["double"], models["ref"], models["text"], "--tokens", "100")
    assert out["tokens"] == 100 and out["windows"] == math.ceil(100 / CONTEXT)
    assert out["kl_mean_nats"] == pytest.approx(kl.mean(), rel=1e-6)
    assert out["kl_mean_nats"] > 0.01
    assert out["kl_p99_nats"] == pytest.approx(np.percentile(kl, 99), rel=1e-6)
    assert out["kl_max_nats"] == pytest.approx(kl.max(), rel=1e-6)
    assert out["top1_agreement"] == 1.0
    n_bytes = len(tok.decode(ids[:101].tolist(), skip_special_tokens=False).encode()) - \
        len(tok.decode(ids[:1].tolist(), skip_special_tokens=False).encode())
    nats_q = -lq[np.arange(100), ids[1:101]].sum()
    nats_p = -lp[np.arange(100), ids[1:101]].sum()
    assert out["bytes"] == n_bytes
    assert out["bits_per_byte"]["model"] == pytest.approx(nats_q / math.log(2) / n_bytes, rel=1e-6)
    assert out["bits_per_byte"]["reference"] == pytest.approx(nats_p / math.log(2) / n_bytes, rel=1e-6)


def test_swapped_rows_lower_agreement_where_the_top_token_moved(models, capsys):
    """Rows 0 and 1 of lm_head swapped: the argmax differs exactly where the reference's is
    token 0 or 1 (and the two logits are not tied)."""
    z, ids, _ = _reference_logits(models["ref"])
    swapped = z.copy()
    swapped[:, [0, 1]] = z[:, [1, 0]]
    expected = float(np.mean(z.argmax(-1) == swapped.argmax(-1)))
    out = _eval(capsys, models["swapped"], models["ref"], models["text"])
    assert out["tokens"] == len(ids) - 1
    assert out["top1_agreement"] == pytest.approx(expected)
    assert expected < 1.0, "the fixture must put tokens 0/1 on top somewhere"
    assert out["kl_mean_nats"] > 0


def test_numerics_applies_to_the_model_and_defaults_to_auto(models, capsys):
    """On an int4 repack, eval's default (auto) runs the model fast and the reference
    exact, so the repack against itself costs a little; --numerics exact costs nothing."""
    from repacked_models import make_in_format

    int4 = make_in_format(models["root"] / "int4", "int4", arch="qwen3_moe", layers=2,
                          experts=4, top_k=2, hidden=64, intermediate=32,
                          initializer_range=0.2, seed=3)
    auto = _eval(capsys, int4, int4, models["text"])
    assert (auto["weights"]["model"]["numerics"], auto["weights"]["reference"]["numerics"]) == (
        "fast", "exact")
    assert 0 < auto["kl_mean_nats"] < 1e-2
    exact = _eval(capsys, int4, int4, models["text"], "--numerics", "exact")
    assert exact["weights"]["model"]["numerics"] == "exact"
    assert exact["kl_max_nats"] == 0 and exact["top1_agreement"] == 1.0


def test_the_result_does_not_depend_on_the_thread_count(models, capsys):
    one = _eval(capsys, models["swapped"], models["ref"], models["text"], "--threads", "1")
    two = _eval(capsys, models["swapped"], models["ref"], models["text"], "--threads", "2")
    assert one == two


def test_models_with_another_tokenizer_are_refused(models, capsys, tmp_path):
    other = tmp_path / "other"
    make_model(other, arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=64,
               intermediate=32, dtype="f32", vocab_size=300)
    assert main(["eval", "--model", str(other), "--reference", str(models["ref"]),
                 "--text", str(models["text"])]) == 1
    assert "share a tokenizer" in capsys.readouterr().err


def test_a_text_that_is_not_utf8_names_the_file(models, capsys, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe")
    assert main(["eval", "--model", str(models["ref"]), "--reference", str(models["ref"]),
                 "--text", str(bad)]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "UTF-8" in err


def test_a_missing_text_is_a_usage_error(models, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", str(models["ref"]), "--reference", str(models["ref"]),
              "--text", str(tmp_path / "nope.txt")])
    assert e.value.code == 2


def test_too_short_a_text_and_too_long_a_window_are_refused(models):
    tok = Tokenizer.from_model_dir(models["ref"])
    with pytest.raises(EvaluationInputError, match="at least 2"):
        token_stream(tok, "")
    model = Model.load(models["ref"], n_threads=1)
    from ext.evaluate import check_comparable
    stream = token_stream(tok, TEXT * 200, context=model.config.max_position_embeddings + 1)
    with pytest.raises(EvaluationInputError, match="max_position_embeddings"):
        check_comparable(model, model, stream)


def test_log_softmax_is_normalised_and_shift_invariant():
    z = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32) * 20
    lp = log_softmax(z)
    assert np.allclose(np.exp(lp).sum(-1), 1.0, atol=1e-12)
    assert np.allclose(lp, log_softmax(z + 100.0), atol=1e-4)
