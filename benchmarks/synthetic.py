"""Synthetic check: does guarduq's ‖∇θ p‖² at the MAP rank inputs like the true posterior does?

For small MLP classifiers on 2-D toy data we can afford what an LLM cannot: a reference posterior
by NUTS (NumPyro). For every evaluation point x we compare, by Spearman ρ,

* the reference: Var_{θ ~ posterior}[p(y=1 | x, θ)], from the MCMC draws;
* guarduq's epistemic score at the MAP: ‖∇θ p(ŷ | x)‖², ŷ the MAP's predicted class (the
  classifier's "response token"; for two classes ∇p(ŷ) = ±∇p(1), so the norm is the same);
* Laplace estimates (linearised GGN: full network, diagonal, last layer), the usual cheap rivals;
* p(1−p) at the MAP (guarduq's aleatoric score), a control: how much of the ranking is just
  "close to the decision boundary"?

The networks use the NTK parameterisation (every parameter a priori N(0, σ²), each layer divides
by √fan_in). WHY: an isotropic Gaussian prior on θ then gives a width-independent function prior
(the usual 1/fan_in-scaled prior of Neal), and the isotropic covariance that the delta method
behind ‖∇θ p‖² assumes is the prior's own shape. The gradient norm depends on the parameterisation;
the posterior over functions does not.

Run ``python benchmarks/synthetic.py --quick`` (< 3 min) or without ``--quick`` (< 25 min on 2
CPU cores). Per-configuration results are appended to a JSONL cache, so an interrupted run
resumes; the markdown page is regenerated between its GENERATED markers and the hand-written text
around them is kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from _pages import write_page  # benchmarks/_pages.py (script folder on sys.path)
from _synthetic_report import nuts_s, plot_maps, plot_rho, render
from scipy.stats import spearmanr
from torch import nn
from torch.func import functional_call, grad, vmap
from tqdm.auto import tqdm

from guarduq.scoring.uncertainty import GradientScorer

REPO = Path(__file__).resolve().parents[1]

# (depth, width) of the hidden layers; parameter counts from ~10² to ~10⁵.
FULL_SIZES = ["1x32", "2x16", "2x32", "2x64", "2x128", "2x256"]
QUICK_SIZES = ["1x32", "2x32", "2x128"]


@dataclass(frozen=True)
class Config:
    """Everything that determines one result row (its hash is the cache key)."""

    dataset: str
    size: str
    n_train: int
    noise: float
    prior_std: float
    seed: int
    num_warmup: int
    num_samples: int
    num_chains: int
    max_tree_depth: int
    grid: int
    n_test: int

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- data


def make_data(name: str, n: int, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two moons or a noisy XOR of four Gaussian blobs (float64 inputs, {0,1} labels)."""
    rng = np.random.default_rng(seed)
    if name == "moons":
        from sklearn.datasets import make_moons

        x, y = make_moons(n, noise=noise, random_state=seed)
        x = (x - np.array([0.5, 0.25])) / np.array([0.9, 0.5])  # roughly centred, unit scale
        return x.astype(np.float64), y.astype(np.float64)
    if name == "xor":
        centres = rng.choice([-1.0, 1.0], size=(n, 2))
        x = centres + noise * 2 * rng.standard_normal((n, 2))
        y = (centres[:, 0] * centres[:, 1] > 0).astype(np.float64)
        return x, y
    raise SystemExit(f"unknown dataset {name!r} (choose moons or xor)")


def make_grid(x: np.ndarray, n: int, margin: float = 1.5) -> np.ndarray:
    lo, hi = x.min(0) - margin, x.max(0) + margin
    gx, gy = np.meshgrid(np.linspace(lo[0], hi[0], n), np.linspace(lo[1], hi[1], n))
    return np.stack([gx.ravel(), gy.ravel()], 1)


# --------------------------------------------------------------------------- the network


def parse_size(size: str) -> list[int]:
    depth, width = (int(s) for s in size.split("x"))
    return [2] + [width] * depth + [1]


class NTKMLP(nn.Module):
    """tanh MLP in NTK parameterisation (each layer divides by √fan_in), float64, torch side.

    Holds the MAP found on the JAX side; guarduq's scores and the Laplace estimates read it here.
    """

    def __init__(self, widths: list[int], params: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.widths = widths
        n = len(widths) - 1
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.as_tensor(np.asarray(params[f"w{i}"]), dtype=torch.float64))
             for i in range(n)]
        )
        self.biases = nn.ParameterList(
            [nn.Parameter(torch.as_tensor(np.asarray(params[f"b{i}"]), dtype=torch.float64))
             for i in range(n)]
        )

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The last hidden layer (input of the output layer)."""
        # Integer indexing only: slicing a ParameterList re-wraps tensors as new leaves, which
        # would cut the graph under torch.func.functional_call.
        h = x
        for i in range(len(self.widths) - 2):
            h = torch.tanh(h @ self.weights[i].T / math.sqrt(self.widths[i]) + self.biases[i])
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logit f(x) of class 1, shape [N]."""
        h = self.features(x)
        return (h @ self.weights[-1].T / math.sqrt(self.widths[-2]) + self.biases[-1])[:, 0]


# --------------------------------------------------------------------------- the density (JAX)


@dataclass(frozen=True)
class Density:
    """The unnormalised log posterior, in JAX. The MAP and NUTS use exactly this one function.

    WHY JAX for the MAP too: under jit a full-batch gradient of a 10⁵-parameter MLP costs well
    under a millisecond on CPU, where eager torch pays per-op overhead hundreds of times over.
    """

    widths: list[int]
    x: Any
    y: Any
    prior_std: float

    def forward(self, params: dict[str, Any], inputs: Any) -> Any:
        import jax.numpy as jnp

        h, n = inputs, len(self.widths) - 1
        for i in range(n):
            h = h @ params[f"w{i}"].T / math.sqrt(self.widths[i]) + params[f"b{i}"]
            if i < n - 1:
                h = jnp.tanh(h)
        return h[:, 0]

    def potential(self, params: dict[str, Any]) -> Any:
        """−log p(θ, D): Bernoulli likelihood with logits, N(0, σ²) on every parameter."""
        import jax
        import jax.numpy as jnp

        f = self.forward(params, self.x)
        log_lik = jnp.sum(self.y * f - jax.nn.softplus(f))
        log_prior = -0.5 * sum(jnp.sum(v**2) for v in params.values()) / self.prior_std**2
        return -(log_lik + log_prior)

    def prior_draw(self, key: Any, batch: tuple[int, ...] = ()) -> dict[str, Any]:
        import jax

        out = {}
        for i in range(len(self.widths) - 1):
            key, kw, kb = jax.random.split(key, 3)
            shape_w = (*batch, self.widths[i + 1], self.widths[i])
            out[f"w{i}"] = self.prior_std * jax.random.normal(kw, shape_w)
            out[f"b{i}"] = self.prior_std * jax.random.normal(kb, (*batch, self.widths[i + 1]))
        return out


def fit_map(density: Density, seed: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """MAP by full-batch L-BFGS (scipy) on the jitted JAX potential, from a prior draw."""
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree
    from scipy.optimize import minimize

    flat0, unravel = ravel_pytree(density.prior_draw(jax.random.PRNGKey(seed)))
    value_and_grad = jax.jit(jax.value_and_grad(lambda v: density.potential(unravel(v))))

    def fun(v: np.ndarray) -> tuple[float, np.ndarray]:
        val, g = value_and_grad(jnp.asarray(v, dtype=flat0.dtype))
        return float(val), np.asarray(g, dtype=np.float64)

    res = minimize(fun, np.asarray(flat0, dtype=np.float64), jac=True, method="L-BFGS-B",
                   options={"maxiter": 20000, "maxcor": 30, "gtol": 1e-5, "ftol": 1e-12})
    params = {k: np.asarray(v, dtype=np.float64) for k, v in unravel(jnp.asarray(res.x)).items()}
    f = np.asarray(density.forward(unravel(jnp.asarray(res.x, dtype=flat0.dtype)), density.x))
    info = {
        "neg_log_joint": float(res.fun),
        "train_acc": float(((f > 0) == np.asarray(density.y)).mean()),
        "grad_max_abs_at_map": float(np.max(np.abs(res.jac))),
        "iterations": int(res.nit),
    }
    return params, info


# --------------------------------------------------------------------------- estimators at the MAP


def logit_jacobian(model: NTKMLP, x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """∇θ f(x) for every row of x, flattened in ``model.parameters()`` order: [N, P]."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f_one(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xi[None],))[0]

    jac_fn = vmap(grad(f_one), in_dims=(None, 0))
    rows = []
    for i in range(0, len(x), chunk):
        g = jac_fn(params, x[i : i + chunk])
        rows.append(torch.cat([g[k].flatten(1) for k in params], 1))
    return torch.cat(rows)


class _AsCausalLM(nn.Module):
    """The MLP seen as a causal LM with a two-token vocabulary, so that guarduq's own
    ``GradientScorer`` scores it: position 0 stands for the input x (set on ``self.x``), the one
    response token is the class; softmax([0, f]) gives p(1) = sigmoid(f)."""

    def __init__(self, mlp: NTKMLP) -> None:
        super().__init__()
        self.mlp = mlp
        self.x: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> SimpleNamespace:
        assert self.x is not None
        f = self.mlp(self.x[None])[0]
        row = torch.stack([torch.zeros_like(f), f])
        return SimpleNamespace(logits=row.expand(1, input_ids.shape[1], 2))


def guarduq_code_path(model: NTKMLP, x: torch.Tensor, y_hat: torch.Tensor) -> np.ndarray:
    """epistemic from guarduq.scoring.uncertainty.GradientScorer, one point at a time (float32 logits)."""
    adapter = _AsCausalLM(model)
    scorer = GradientScorer(adapter)
    out = np.empty(len(x))
    for i in range(len(x)):
        adapter.x = x[i]
        ids = torch.tensor([[0, int(y_hat[i])]])
        out[i] = scorer.score(ids, response_start=1).epistemic
    return out


def estimators(
    model: NTKMLP, x_train: torch.Tensor, x_eval: torch.Tensor, prior_std: float
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Every MAP-based estimate of Var_post[p(y=1|x)] at ``x_eval`` (and the seconds each took).

    Linearised Laplace: f(x; θ) ≈ f(x; θ̂) + j(x)ᵀ(θ − θ̂), posterior N(θ̂, Σ) with
    Σ⁻¹ = JᵀΛJ + I/σ² (GGN, Λ = p(1−p) on the training set); Var[p] ≈ (p(1−p))² jᵀΣj.
    The full Σ is never formed: with B = Λ^½ J (n × P, n ≪ P), Woodbury gives
    jᵀΣj = σ²‖j‖² − σ⁴ (Bj)ᵀ(I + σ² BBᵀ)⁻¹(Bj). With the data term removed this is σ²‖j‖², and
    (p(1−p))²‖j‖² is exactly guarduq's ‖∇θ p‖²: the isotropic delta method is a Laplace
    approximation that ignores the data's curvature.
    """
    s2 = prior_std**2
    times: dict[str, float] = {}
    with torch.no_grad():
        p_eval = torch.sigmoid(model(x_eval))
        p_train = torch.sigmoid(model(x_train))
    dp = p_eval * (1 - p_eval)
    out: dict[str, np.ndarray] = {"aleatoric": dp.numpy()}

    t0 = time.perf_counter()
    j_eval = logit_jacobian(model, x_eval)
    j_sq = j_eval.pow(2).sum(1)
    out["guarduq"] = (dp**2 * j_sq).numpy()
    times["guarduq_per_point_s"] = (time.perf_counter() - t0) / len(x_eval)

    t0 = time.perf_counter()
    j_train = logit_jacobian(model, x_train)
    b = j_train * (p_train * (1 - p_train)).sqrt()[:, None]
    chol = torch.linalg.cholesky(torch.eye(len(b), dtype=b.dtype) + s2 * b @ b.T)
    bj = b @ j_eval.T
    var_f = s2 * j_sq - s2**2 * (bj * torch.cholesky_solve(bj, chol)).sum(0)
    out["laplace_full"] = (dp**2 * var_f.clamp_min(0)).numpy()
    times["laplace_full_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    h_diag = 1 / s2 + (b**2).sum(0)
    out["laplace_diag"] = (dp**2 * (j_eval**2 / h_diag).sum(1)).numpy()
    times["laplace_diag_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    with torch.no_grad():
        scale = 1 / math.sqrt(model.widths[-2])

        def phi(x: torch.Tensor) -> torch.Tensor:  # ∂f/∂(last W, last b)
            h = model.features(x) * scale
            return torch.cat([h, torch.ones(len(x), 1, dtype=h.dtype)], 1)

        phi_t = phi(x_train)
        prec = phi_t.T @ (phi_t * (p_train * (1 - p_train))[:, None])
        prec += torch.eye(len(prec), dtype=prec.dtype) / s2
        phi_e = phi(x_eval)
        var_ll = (phi_e * torch.linalg.solve(prec, phi_e.T).T).sum(1)
    out["laplace_last"] = (dp**2 * var_ll).numpy()
    times["laplace_last_s"] = time.perf_counter() - t0
    return out, times


def check_against_guarduq(
    model: NTKMLP, x: torch.Tensor, ours: np.ndarray, n: int = 100
) -> tuple[float, float]:
    """The batched formula must equal guarduq's own GradientScorer (on ``n`` points).

    Returns (largest relative difference, GradientScorer seconds per point). Raises if they
    differ: the benchmark would otherwise be measuring some other quantity.
    """
    x = x[:n]
    with torch.no_grad():
        y_hat = (model(x) > 0).long()
    t0 = time.perf_counter()
    theirs = guarduq_code_path(model, x, y_hat)
    per_point = (time.perf_counter() - t0) / len(x)
    rel = np.abs(ours[:n] - theirs) / np.maximum(np.abs(theirs), 1e-300)
    worst = float(np.max(rel))
    if not worst < 1e-6:
        raise RuntimeError(f"GradientScorer disagrees with the ‖∇θp‖² formula (rel {worst:.2e})")
    return worst, per_point


# --------------------------------------------------------------------------- reference posterior


def run_nuts(
    cfg: Config, density: Density, x_eval: np.ndarray
) -> tuple[np.ndarray, dict[str, Any]]:
    """Posterior draws of p(y=1|x_eval): array [chains, samples, points], plus diagnostics."""
    import jax
    import jax.numpy as jnp
    from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
    from numpyro.infer import MCMC, NUTS

    xe = jnp.asarray(x_eval)
    # Chains start from independent prior draws, not from the MAP: a chain started at the MAP
    # could stay in its basin and flatter the local (MAP-based) estimators.
    key, init_key = jax.random.split(jax.random.PRNGKey(cfg.seed + 1))
    init = density.prior_draw(init_key, (cfg.num_chains,))
    n_dev = jax.local_device_count()
    mcmc = MCMC(
        NUTS(potential_fn=density.potential, max_tree_depth=cfg.max_tree_depth, target_accept_prob=0.8),
        num_warmup=cfg.num_warmup,
        num_samples=cfg.num_samples,
        num_chains=cfg.num_chains,
        chain_method="parallel" if n_dev >= cfg.num_chains else "sequential",
        progress_bar=False,
    )
    t0 = time.perf_counter()
    mcmc.run(key, init_params=init, extra_fields=("num_steps", "diverging"))
    # JAX dispatches asynchronously: without blocking here the timer stops before the sampling
    # is done and the wait shows up in whatever touches the samples first.
    samples = jax.block_until_ready(mcmc.get_samples(group_by_chain=True))
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    extra = mcmc.get_extra_fields(group_by_chain=True)
    flat = {k: v.reshape((-1,) + v.shape[2:]) for k, v in samples.items()}
    probs = jax.lax.map(lambda s: jax.nn.sigmoid(density.forward(s, xe)), flat, batch_size=64)
    probs = np.asarray(probs, dtype=np.float64).reshape(cfg.num_chains, cfg.num_samples, -1)
    diag = {
        "mcmc_s": seconds,
        "predictive_s": time.perf_counter() - t1,
        "mean_leapfrog_steps": float(np.mean(extra["num_steps"])),
        "max_tree_depth_hits": float(np.mean(extra["num_steps"] >= 2**cfg.max_tree_depth - 1)),
        "divergences": int(np.sum(extra["diverging"])),
        "chain_method": "parallel" if n_dev >= cfg.num_chains else "sequential",
    }
    if cfg.num_chains >= 2:
        rhat = np.asarray(split_gelman_rubin(probs))
        diag["rhat_pred_median"] = float(np.nanmedian(rhat))
        diag["rhat_pred_max"] = float(np.nanmax(rhat))
    diag["ess_pred_median"] = float(np.nanmedian(np.asarray(effective_sample_size(probs))))
    return probs, diag


# --------------------------------------------------------------------------- one configuration


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(spearmanr(a, b).statistic)


def run_one(cfg: Config) -> dict[str, Any]:
    import jax.numpy as jnp

    t_start = time.perf_counter()
    widths = parse_size(cfg.size)
    x, y = make_data(cfg.dataset, cfg.n_train, cfg.noise, cfg.seed)
    x_test, y_test = make_data(cfg.dataset, cfg.n_test, cfg.noise, cfg.seed + 1000)
    grid = make_grid(x, cfg.grid)
    x_eval = np.concatenate([grid, x_test])
    n_grid = len(grid)
    density = Density(widths, jnp.asarray(x), jnp.asarray(y), cfg.prior_std)

    t0 = time.perf_counter()
    params, map_info = fit_map(density, cfg.seed)
    map_info["seconds"] = time.perf_counter() - t0
    model = NTKMLP(widths, params)
    n_params = sum(p.numel() for p in model.parameters())
    xt, xe = torch.from_numpy(x), torch.from_numpy(x_eval)
    scores, times = estimators(model, xt, xe, cfg.prior_std)
    check_rel, times["guarduq_code_path_per_point_s"] = check_against_guarduq(
        model, xe, scores["guarduq"]
    )
    with torch.no_grad():
        p_map = torch.sigmoid(model(xe)).numpy()

    probs, diag = run_nuts(cfg, density, x_eval)
    ref = probs.reshape(-1, probs.shape[-1]).var(0)
    p_post = probs.reshape(-1, probs.shape[-1]).mean(0)

    splits = {"grid": slice(0, n_grid), "test": slice(n_grid, None)}
    rho = {
        split: {m: spearman(ref[s], v[s]) for m, v in scores.items()} for split, s in splits.items()
    }
    if cfg.num_chains >= 2:  # how well the reference reproduces itself: a ceiling for the rest
        var_a, var_b = probs[0].var(0), probs[1].var(0)
        for split, s in splits.items():
            rho[split]["mcmc_chain_vs_chain"] = spearman(var_a[s], var_b[s])
    return {
        "key": cfg.key(),
        "config": asdict(cfg),
        "n_params": n_params,
        "rho": rho,
        "map": map_info,
        "test_acc_map": float(((p_map[n_grid:] > 0.5) == y_test).mean()),
        "test_acc_posterior": float(((p_post[n_grid:] > 0.5) == y_test).mean()),
        "guarduq_check_max_rel_err": check_rel,
        "times": {**times, "row_s": time.perf_counter() - t_start},
        "mcmc": diag,
        # kept for the maps figure (grid only, float32 precision is plenty for a picture)
        "grid_maps": {
            "x": grid.round(4).tolist(),
            "mcmc_var": ref[:n_grid].astype(np.float32).tolist(),
            "guarduq": scores["guarduq"][:n_grid].astype(np.float32).tolist(),
            "laplace_full": scores["laplace_full"][:n_grid].astype(np.float32).tolist(),
            "train_x": x.round(4).tolist(),
            "train_y": y.tolist(),
        },
    }


# --------------------------------------------------------------------------- cache (plots and page: _synthetic_report.py)


def load_cache(path: Path) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interrupted run: ignore it
                continue
            rows[row["key"]] = row
    return rows


def append_row(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small sizes, short chains (< 3 min); own cache and output folder "
                         "under runs/bench (the committed page is left alone)")
    ap.add_argument("--datasets", nargs="+", default=None, help="moons and/or xor")
    ap.add_argument("--sizes", nargs="+", default=None, help="DEPTHxWIDTH, e.g. 2x64")
    ap.add_argument("--n-train", type=int, default=100)
    ap.add_argument("--noise", type=float, default=0.2)
    ap.add_argument("--prior-std", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-warmup", type=int, default=None)
    ap.add_argument("--num-samples", type=int, default=None)
    ap.add_argument("--num-chains", type=int, default=2)
    ap.add_argument("--max-tree-depth", type=int, default=8)
    ap.add_argument("--grid", type=int, default=30)
    ap.add_argument("--n-test", type=int, default=500)
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="default docs/results (--quick: runs/bench/results-quick)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="default runs/bench/synthetic[-quick].jsonl")
    args = ap.parse_args(argv)
    bench = REPO / "runs" / "bench"
    args.out_dir = args.out_dir or (bench / "results-quick" if args.quick else REPO / "docs" / "results")
    args.cache = args.cache or bench / ("synthetic-quick.jsonl" if args.quick else "synthetic.jsonl")

    # One XLA CPU device per chain so chains run in parallel; must be set before jax loads.
    os.environ.setdefault(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={max(1, args.num_chains)}"
    )
    # One torch thread: on a shared 2-core box, two spinning OpenMP threads were 10x slower.
    torch.set_num_threads(1)
    args.load_at_start = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    datasets = args.datasets or (["moons"] if args.quick else ["moons", "xor"])
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    warmup = args.num_warmup or (200 if args.quick else 500)
    samples = args.num_samples or (200 if args.quick else 500)
    stem = "synthetic-quick" if args.quick else "synthetic"

    configs = [
        Config(ds, size, args.n_train, args.noise, args.prior_std, args.seed, warmup, samples,
               args.num_chains, args.max_tree_depth, args.grid, args.n_test)
        for ds in datasets for size in sizes
    ]
    cache = load_cache(args.cache)
    t0 = time.perf_counter()
    rows = []
    for cfg in tqdm(configs, desc="synthetic", file=sys.stderr):
        row = cache.get(cfg.key())
        if row is None:
            row = run_one(cfg)
            append_row(args.cache, row)
        rows.append(row)
        g = row["rho"]["grid"]
        tqdm.write(
            f"{cfg.dataset} {cfg.size} ({row['n_params']:,} params): ρ guarduq {g['guarduq']:.2f}, "
            f"Laplace full {g['laplace_full']:.2f}, NUTS {nuts_s(row)}s",
            file=sys.stderr,
        )
    wall = time.perf_counter() - t0

    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot_rho(rows, args.out_dir / f"{stem}_rho.png")
    largest = max((r for r in rows if r["config"]["dataset"] == datasets[0]),
                  key=lambda r: r["n_params"])
    plot_maps(largest, args.out_dir / f"{stem}_maps.png")
    title = "Synthetic check: guarduq's gradient score vs an MCMC posterior"
    write_page(args.out_dir / f"{stem}.md", render(rows, args, stem, wall), title)
    print(f"wrote {args.out_dir / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
