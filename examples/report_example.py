"""A picture of a checkpoint: ``arrayckpt report`` on a small transformer-like state and a later step of it.

Saves step 100 of a tiny decoder (embeddings, 6 layers, head; bfloat16 weights and float32 AdamW moments), then
step 200 as a delta against it after "training" moved the last layers most and touched a few embedding rows and
a block of the head's, and writes ``report.html`` for step 200 against step 100 plus the overview picture
``docs/report-example.png`` (the one ``docs/guide/report.md`` shows). Run from the repository root:

    python examples/report_example.py [--out DIR]

Needs torch (to save) and matplotlib (``pip install 'arrayckpt[report]'``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import arrayckpt

WIDTH, LAYERS, VOCAB = 128, 6, 8192
PICTURE = Path(__file__).resolve().parent.parent / "docs" / "report-example.png"


def tiny_decoder(seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights named as in Hugging Face's Llama (``layers.<i>.self_attn.q_proj.weight``)."""
    g = torch.Generator().manual_seed(seed)
    weights = {"embed_tokens.weight": torch.randn(VOCAB, WIDTH, generator=g) * 0.02}
    for i in range(LAYERS):
        prefix = f"layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weights[f"{prefix}.self_attn.{name}.weight"] = torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5
        weights[f"{prefix}.mlp.up_proj.weight"] = torch.randn(4 * WIDTH, WIDTH, generator=g) / WIDTH ** 0.5
        weights[f"{prefix}.mlp.down_proj.weight"] = torch.randn(WIDTH, 4 * WIDTH, generator=g) / (4 * WIDTH) ** 0.5
        weights[f"{prefix}.input_layernorm.weight"] = torch.ones(WIDTH)
    weights["norm.weight"] = torch.ones(WIDTH)
    weights["lm_head.weight"] = torch.randn(VOCAB, WIDTH, generator=g) * 0.02
    return weights


def moments_of(weights: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's moments (none for the layer norms, as if they were frozen)."""
    g = torch.Generator().manual_seed(2)
    return {name: {"exp_avg": torch.randn(w.shape, generator=g) * 1e-3, "exp_avg_sq": torch.rand(w.shape, generator=g)
                   * 1e-6} for name, w in weights.items() if not name.endswith("layernorm.weight")}


def state_of(weights: dict[str, torch.Tensor], moments: dict, step: int) -> dict:
    """bfloat16 weights, float32 moments, the step."""
    return {"model": {k: v.to(torch.bfloat16) for k, v in weights.items()}, "optim": {"state": moments},
            "step": step}


def scale_of(name: str) -> float:
    """How much "training" moves a tensor: layer i by 1e-3 * 4 ** (i - 2) of its spread, the rest not at all."""
    return 1e-3 * 4 ** (int(name.split(".")[1]) - 2) if name.startswith("layers.") else 0.0


def train(weights: dict[str, torch.Tensor], moments: dict) -> tuple[dict[str, torch.Tensor], dict, torch.Tensor]:
    """A later step: the last layers (and their moments) move most, the first barely, a few embedding rows
    and a block of the head's rows change."""
    g = torch.Generator().manual_seed(1)

    def moved(name: str, t: torch.Tensor) -> torch.Tensor:
        scale = scale_of(name)
        return t + scale * torch.randn(t.shape, generator=g) * t.std().clamp(min=1e-6) if scale else t.clone()

    later = {name: moved(name, w) for name, w in weights.items()}
    later_moments = {name: {k: moved(name, v) for k, v in m.items()} for name, m in moments.items()}
    rows = torch.tensor([5, 17, 901, 4000, 4001, 8100])
    later["embed_tokens.weight"][rows] += 0.05
    block = slice(2048, 4096)  # the output rows of tokens a new domain uses: whole chunks of the head change
    later["lm_head.weight"][block] += 0.002 * torch.randn(2048, WIDTH, generator=g)
    for moment in later_moments["lm_head.weight"].values():
        moment[block] *= 1.1
    return later, later_moments, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where the checkpoints and report.html go (default: "
                        "a temporary directory)")
    parser.add_argument("--picture", type=Path, default=PICTURE, help=f"the overview PNG (default {PICTURE})")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="arrayckpt-report-"))
    ckpt = out / "ckpt"
    weights = tiny_decoder()
    moments = moments_of(weights)
    arrayckpt.save(state_of(weights, moments, 100), ckpt / "step-100", step=100, overwrite=True)
    later, later_moments, rows = train(weights, moments)
    later_moments["layers.5.mlp.down_proj.weight"]["exp_avg"][0, :3] = float("nan")  # a bug to spot
    arrayckpt.save(state_of(later, later_moments, 200), ckpt / "step-200", step=200, base=ckpt / "step-100",
                   overwrite=True, changed_rows={"model.embed_tokens.weight": rows})
    html = arrayckpt.report(ckpt / "step-200", against=ckpt / "step-100", output=out / "report.html",
                            overview=args.picture)
    print(f"wrote {html} and {args.picture} ({args.picture.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
