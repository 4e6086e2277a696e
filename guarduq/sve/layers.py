"""SVE's layer and where it goes: the SVD-parametrised linear map, the module selection, and the
pre-hooks that run the frozen blocks before the first SVE block once for all members."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from guarduq.errors import GuardUQError, SVEError
from guarduq.scoring.uncertainty import select_parameters

# Short module names SVE can target: Llama-style projections and GPT-2's fused Conv1D layers.
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")
KNOWN_TARGETS = LLAMA_TARGETS + GPT2_TARGETS


# --------------------------------------------------------------------------- the layer


PARAMETRISATIONS = ("relative", "raw")
BIAS_MODES = ("scaled", "none", "raw")


class SVELinear(nn.Module):
    """A linear map shared by M members through frozen ``U``, ``V``; member m owns Σᵐ and bᵐ.

    ``U`` [out, r] and ``V`` [in, r] are buffers (never trained, saved with the model copy only).
    How member m's spectrum and bias are parametrised (the trainable tensors, each [M, ...]):

    * ``parametrisation="relative"`` (default): ``delta`` [M, r], Σᵐ = Σ ⊙ exp(δᵐ). Σᵐ stays
      positive, and an optimiser step on δ is a relative step on every singular value, whatever
      the layer's scale. Init δ ~ N(0, sigma_init²): exp(δ) has log-spread sigma_init, i.e. to
      first order the same relative spread of the members' spectra as the raw init below.
    * ``parametrisation="raw"`` (the first SVE, still loadable): ``sigma`` [M, r],
      Σᵐ = Σ ⊙ (1 + εᵐ), εᵐ ~ N(0, sigma_init²), trained in the singular values' own units.
    * ``bias_mode="scaled"`` (default): ``beta`` [M, out] from 0, bᵐ = b₀ + s·βᵐ, where b₀ is the
      base layer's bias (0 if none) and s = ‖W‖_F/√out, the RMS of the layer's output for
      unit-variance, uncorrelated inputs (E‖Wx‖² = ‖W‖_F² then). From the weights alone: no
      data, the same on every load, and it scales with W, so a bias step is relative too.
    * ``bias_mode="none"``: no trained bias (the base bias, if any, is kept): an ablation.
    * ``bias_mode="raw"``: ``bias`` [M, out] from b₀, in absolute units (the first SVE).
    """

    def __init__(
        self,
        U: torch.Tensor,
        S: torch.Tensor,
        V: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        members: int,
        sigma_init: float,
        generator: torch.Generator,
        parametrisation: str = "relative",
        bias_mode: str = "scaled",
    ) -> None:
        super().__init__()
        check_parametrisation(parametrisation, bias_mode)
        self.members, self.parametrisation, self.bias_mode = members, parametrisation, bias_mode
        self.in_features = int(V.shape[0])
        self.out_features = int(U.shape[0])
        self.register_buffer("U", U.contiguous())
        self.register_buffer("V", V.contiguous())
        self.register_buffer("S", S.clone(), persistent=False)  # the base spectrum
        eps = torch.randn(members, S.numel(), generator=generator, dtype=torch.float64) * sigma_init
        if parametrisation == "raw":
            self.sigma = nn.Parameter((S.double() * (1.0 + eps)).to(S.dtype))
        else:
            self.delta = nn.Parameter(eps.to(S.dtype))
        b0 = None if bias is None else bias.detach().to(U.dtype).clone()
        if bias_mode == "raw":
            start = torch.zeros(self.out_features, dtype=U.dtype) if b0 is None else b0
            self.bias = nn.Parameter(start.expand(members, -1).clone())
            return
        self.register_buffer("bias0", b0, persistent=False)
        if bias_mode == "scaled":
            scale = S.double().square().sum().sqrt() / math.sqrt(self.out_features)
            self.register_buffer("bias_scale", scale.to(U.dtype), persistent=False)
            self.beta = nn.Parameter(torch.zeros(members, self.out_features, dtype=U.dtype))

    def trainable(self) -> list[nn.Parameter]:
        """The trained tensors, in a fixed order (Σ's, then the bias's when there is one)."""
        return list(self.parameters(recurse=False))

    def spectrum(self) -> torch.Tensor:
        """Σᵐ of every member, [M, r]."""
        return self.sigma if self.parametrisation == "raw" else self.S * torch.exp(self.delta)

    def member_bias(self) -> torch.Tensor | None:
        """bᵐ of every member, [M, out] (or [1, out] when members share it; None: no bias)."""
        if self.bias_mode == "raw":
            return self.bias
        if self.bias_mode == "scaled":
            b = self.bias_scale * self.beta
            return b if self.bias0 is None else self.bias0 + b
        return None if self.bias0 is None else self.bias0.unsqueeze(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.shape[0] % self.members:
            raise SVEError(
                f"SVE layer got a batch of {x.shape[0]} rows, not a multiple of M={self.members}; "
                "call the ensemble's methods, which fold the member dimension into the batch"
            )
        h = x.reshape(self.members, -1, self.in_features) @ self.V  # [M, N, r]
        h = h * self.spectrum().unsqueeze(1)
        y = h @ self.U.T  # [M, N, out]
        b = self.member_bias()
        if b is not None:
            y = y + b.unsqueeze(1)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, rank={self.V.shape[1]}, members={self.members}, "
                f"parametrisation={self.parametrisation}, bias={self.bias_mode}")


def check_parametrisation(parametrisation: Any, bias_mode: Any) -> None:
    """Typed errors for an unknown parametrisation or bias mode."""
    if parametrisation not in PARAMETRISATIONS:
        raise SVEError(f"parametrisation must be one of {', '.join(PARAMETRISATIONS)}, got {parametrisation!r}")
    if bias_mode not in BIAS_MODES:
        raise SVEError(f"bias must be one of {', '.join(BIAS_MODES)}, got {bias_mode!r}")


def _weight_as_linear(module: nn.Module) -> torch.Tensor:
    """The [out, in] matrix of an ``nn.Linear`` or a transformers ``Conv1D`` (stored [in, out])."""
    w = module.weight.detach()
    return w.T if type(module).__name__ == "Conv1D" else w


def _is_matrix_layer(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None


class _PrefixSharing:
    """Run the blocks before the first SVE block once per input row, then fan out to M members.

    Those blocks are frozen and identical for every member, so computing them M times is waste.
    Forward pre-hooks on the blocks from the first targeted one on repeat the hidden states
    (first block) and every batch-indexed tensor argument (mask, position ids, rotary tables)
    M times, member-major. Active only while ``rows`` is set, i.e. inside ``SVEnsemble`` calls
    whose members all see the same inputs; training (different rows per member) folds instead.
    """

    def __init__(self, blocks: Sequence[nn.Module], members: int) -> None:
        self.members = members
        self.rows: int | None = None
        self.handles = [
            block.register_forward_pre_hook(self._hook(first=i == 0), with_kwargs=True)
            for i, block in enumerate(blocks)
        ]

    def _expand(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == self.rows:
            return value.repeat(self.members, *([1] * (value.dim() - 1)))
        if isinstance(value, tuple):
            return tuple(self._expand(v) for v in value)
        return value

    def _hook(self, *, first: bool) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self.rows is None:
                return None
            if first:  # the hidden states enter the first SVE block once per member
                hidden, rest = args[0], tuple(self._expand(a) for a in args[1:])
                args = (hidden.repeat(self.members, *([1] * (hidden.dim() - 1))), *rest)
            else:
                args = (args[0], *(self._expand(a) for a in args[1:]))
            return args, {k: self._expand(v) for k, v in kwargs.items()}

        return hook


# --------------------------------------------------------------------------- module helpers

_BLOCK = re.compile(r"\.(?:layers|h|blocks|block|layer)\.(\d+)\.")


def _same_logits(shared: torch.Tensor, folded: torch.Tensor) -> bool:
    """Whether prefix sharing reproduced plain folding, up to float rounding.

    The two run the same blocks on differently shaped batches, so their matmuls may take other
    kernels and round differently: on SmolLM2 in fp32 (30 blocks, logits up to ~33) the gap is
    ~7e-5, most of it on logits near 0, where an elementwise ``allclose`` fails. The bound is
    therefore on the largest gap, relative to the largest logit: 1e-4 of it. A wrong fan-out of
    rows changes logits by O(1), far above that.
    """
    scale = float(folded.abs().max())
    return float((shared - folded).abs().max()) <= 1e-4 * scale + 1e-6


def _block_of(name: str, *, own: bool = False) -> int | None:
    """Index of the transformer block containing module ``name`` (``own``: name IS the block)."""
    m = _BLOCK.search(f".{name}.")
    if m is None or (own and m.end() != len(name) + 2):
        return None
    return int(m.group(1))


def _block_indices(model: nn.Module) -> set[int]:
    return {b for n, _ in model.named_modules() if (b := _block_of(n)) is not None}


def validate_settings(
    members: Any, targets: str | Sequence[str] | None, sigma_init: Any,
    parametrisation: Any = "relative", bias: Any = "scaled",
) -> tuple[str, ...]:
    """Check the ensemble's settings before any model work; returns the target names."""
    check_parametrisation(parametrisation, bias)
    if isinstance(members, bool) or not isinstance(members, int) or members < 2:
        raise SVEError(f"an ensemble needs members >= 2, got {members!r}")
    if isinstance(sigma_init, bool) or not isinstance(sigma_init, int | float) or not math.isfinite(sigma_init) or sigma_init < 0:
        raise SVEError(f"sigma_init must be a finite number >= 0, got {sigma_init!r}")
    return _validate_targets(targets)


def _validate_targets(targets: str | Sequence[str] | None) -> tuple[str, ...]:
    if targets is None:
        return KNOWN_TARGETS
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = tuple(dict.fromkeys(targets))
    if not targets:
        raise SVEError("targets is empty")
    unknown = [t for t in targets if t not in KNOWN_TARGETS]
    if unknown:
        raise SVEError(f"unknown SVE target(s) {unknown}; known: {', '.join(KNOWN_TARGETS)}")
    return targets


def _select_modules(model: nn.Module, targets: Sequence[str], last_n_blocks: int | None) -> list[str]:
    """Names of the matrix layers to replace, sorted; errors say why nothing matched."""
    names = sorted(
        n for n, m in model.named_modules() if n.rpartition(".")[2] in targets and _is_matrix_layer(m)
    )
    if not names:
        raise SVEError(
            f"the model has no linear/Conv1D layers named {list(targets)}; "
            f"SVE supports {', '.join(KNOWN_TARGETS)}"
        )
    if last_n_blocks is not None:
        if isinstance(last_n_blocks, bool) or not isinstance(last_n_blocks, int):
            raise SVEError(f"last_n_blocks must be an integer, got {last_n_blocks!r}")
        try:
            keep = {n for n, _ in select_parameters(model, last_n_blocks=last_n_blocks)}
        except GuardUQError as exc:
            raise SVEError(f"cannot restrict SVE to the last blocks: {exc}") from exc
        names = [n for n in names if f"{n}.weight" in keep]
        if not names:
            raise SVEError(f"no target layers in the last {last_n_blocks} blocks")
    return names


def _hidden_size(model: nn.Module) -> int:
    cfg = model.config
    for key in ("hidden_size", "n_embd", "d_model"):
        value = getattr(cfg, key, None)
        if isinstance(value, int):
            return value
    raise SVEError("cannot read the model's hidden size from its config")
