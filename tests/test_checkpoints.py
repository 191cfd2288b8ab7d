"""A user's checkpoint folder as the model: resolved to a family by its architecture, read
without running anything of it, every bad input one message naming what was found and what is
allowed, nothing half-loaded; the Llama family gated against a LlamaForCausalLM of its own
config; ``--model PATH`` in the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import families
from engine.models import checkpoint, loader
from engine.models.loader import WeightsError
from instruments import cli, lineup
from instruments.costmodel import kv_plan

from .family_gate import gate_every_mode, save_tiny

pytestmark = pytest.mark.timeout(900)
# GQA (4 query heads, 2 K/V), untied, a RoPE base and epsilon that are not the defaults: read
# from the wrong key, either would change the logits. Weights of std 0.12: greedy streams varied
# enough for a wrong cache to show, and Q4_1's rounding (measured 32%) inside its 40%
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
            rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.12)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    folder = tmp_path_factory.mktemp("llama")
    return folder, save_tiny(LlamaForCausalLM, LlamaConfig, folder, **TINY)


def test_a_folder_resolves_to_its_family_and_config(llama_dir) -> None:
    folder, _ = llama_dir
    p = lineup.preset(str(folder))
    assert p.family == "llama" and p.weights == ("checkpoint", "random")
    cfg = lineup.config(str(folder))
    assert (cfg.n_kv_head, cfg.rope_theta, cfg.norm_eps, cfg.tied) == (2, 5000.0, 1e-5, False)
    assert lineup.offline_weights(str(folder)) == "checkpoint"


def test_the_llama_family_matches_transformers_at_every_mode(llama_dir) -> None:
    folder, hf = llama_dir
    state = families.load(str(folder))
    assert state.provenance.label == f"local checkpoint ({folder.name})"
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    strays = gate_every_mode(state, hf, prompt, 12)
    assert {"uncached", "prealloc_fused", "fast", "cuda_graph", "compiled", "int8_weights",
            "q8_0_weights"} <= set(strays)


def test_config_alone_is_planned_and_runs_with_random_weights(tmp_path: Path) -> None:
    big = dict(TINY, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
               max_position_embeddings=131072)
    LlamaConfig(**big).save_pretrained(tmp_path)  # a 70B model's config: no weights
    p = lineup.preset(str(tmp_path))
    assert p.weights == ("random",)
    cfg = lineup.config(str(tmp_path))
    assert kv_plan.kv_bytes_per_token(cfg, "bfloat16") == 2 * 80 * 8 * 128 * 2
    with pytest.raises(WeightsError, match=r"needs 26\d.\d\d GiB of weights; cpu has"):
        families.load(str(tmp_path), "random")  # refused before anything is allocated
    small = tmp_path / "small"
    LlamaConfig(**TINY).save_pretrained(small)
    assert families.load(str(small)).provenance.label == "random (seed 0)"
    with pytest.raises(WeightsError, match="holds config.json but no weights; allowed"):
        families.load(str(small), "checkpoint")


def _bad(tmp_path: Path, fields: dict | None, tensors: dict | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    if fields is not None:
        (tmp_path / "config.json").write_text(json.dumps(fields))
    if tensors is not None:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_bad_folders_each_get_one_message(tmp_path: Path, llama_dir) -> None:
    with pytest.raises(ValueError, match=r"holds no config.json \(found: nothing\); allowed"):
        lineup.preset(str(_bad(tmp_path / "empty", None)))
    with pytest.raises(ValueError, match="architecture FalconForCausalLM, falcon; allowed: "
                       ".*LlamaForCausalLM"):
        lineup.preset(str(_bad(tmp_path / "falcon", {"architectures": ["FalconForCausalLM"],
                                                      "model_type": "falcon"})))
    with pytest.raises(ValueError, match="RoPE scaling 'yarn'; allowed: none"):
        lineup.preset(str(_bad(tmp_path / "yarn", dict(
            TINY, architectures=["LlamaForCausalLM"],
            rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))))
    with pytest.raises(ValueError, match="no such file or folder"):
        lineup.preset(str(tmp_path / "absent" / "x"))
    folder, _ = llama_dir
    fields = json.loads((folder / "config.json").read_text())
    good = checkpoint.Folder(folder)
    tensors = {n: good.tensor(n) for n in good.shapes}
    short = dict(tensors)
    del short["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightsError, match=r"lacks 1 of the model's tensors \(first: "
                       r"model.layers.1.mlp.up_proj.weight\)"):
        families.load(str(_bad(tmp_path / "short", fields, short)))
    wrong = dict(tensors, **{"model.norm.weight": torch.ones(65)})
    with pytest.raises(WeightsError, match=r"model.norm.weight is \(65,\); its config implies "
                       r"\(64,\)"):
        families.load(str(_bad(tmp_path / "wrong", fields, wrong)))


def test_a_larger_than_memory_checkpoint_is_refused_before_anything_is_built(
        llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = llama_dir
    monkeypatch.setattr(loader, "available_bytes", lambda device: 1000)
    built = []
    monkeypatch.setattr(checkpoint, "load_into", lambda *a: built.append(a))
    with pytest.raises(WeightsError, match=r"needs 0.00 GiB of weights; cpu has 0.00 GiB "
                       "available; allowed: a checkpoint that fits"):
        families.load(str(folder))
    assert not built


def test_nothing_pickled_executes(tmp_path: Path, llama_dir) -> None:
    """A .bin is read with torch.load(weights_only=True): plain tensors load, anything else
    (here an object whose unpickling would run code) is refused."""
    folder, hf = llama_dir
    fields = json.loads((folder / "config.json").read_text())
    plain = _bad(tmp_path / "plain", fields)
    torch.save({k: v.clone() for k, v in hf.state_dict().items()}, plain / "pytorch_model.bin")
    state = families.load(str(plain))
    idx = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.allclose(state.model(idx)[0], hf(idx).logits, atol=1e-4)
    evil = _bad(tmp_path / "evil", fields)
    torch.save({"x": torch.zeros(1), "run": Path("/tmp")}, evil / "pytorch_model.bin")
    with pytest.raises(WeightsError, match=r"refused: torch.load\(weights_only=True\)"):
        families.load(str(evil))


def test_a_preset_given_another_familys_folder_says_so(llama_dir) -> None:
    folder, _ = llama_dir
    with pytest.raises(ValueError, match="holds a Llama model; 'gpt2' is GPT-2: pass the path "
                       "as the model"):
        families.load("gpt2", str(folder))


def test_the_cli_takes_a_path_as_the_model(llama_dir, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    folder, _ = llama_dir
    assert cli.main(["sweep", "--model", str(folder), "--contexts", "4,8", "--repeats", "1",
                     "--new-tokens", "3", "--no-peaks", "--no-progress", "--modes",
                     "prealloc_fused", "--results-dir", str(tmp_path)]) == 0
    run = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert run["meta"]["family"] == "llama"
    assert run["meta"]["weights"] == f"local checkpoint ({folder.name})"
    assert cli.main(["sweep", "--model", str(tmp_path / "nothing-here"),
                     "--results-dir", str(tmp_path)]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_the_sidebar_takes_a_path_as_the_model(llama_dir, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """The Model list's last entry reads a checkpoint's path (a deep link's too); one that is
    no checkpoint is said why, and the first preset is used."""
    from ui.apptest import open_page

    monkeypatch.setenv("KVLAB_RESULTS_DIR", str(tmp_path))
    folder, _ = llama_dir
    at = open_page("memory", {"model": str(folder)})
    assert at.session_state["choice"].model == str(folder)
    assert at.session_state["choice"].weights == "checkpoint"
    at = open_page("memory", {"model": str(tmp_path / "absent")})
    assert any("no such file or folder" in e.value for e in at.sidebar.error)
    assert at.session_state["choice"].model == "gpt2"
