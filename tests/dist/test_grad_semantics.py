"""Gradient semantics like torch: ``loss.backward()`` instead of ``engine.backward(loss)``, several backward passes
before a step, and ``zero_grad()`` on the engine, its optimizer or the user's module clearing everything
([Note: autograd-started backward] in training/backward_passes.py, [Note: gradient markers] in
zero/grad_markers.py, [Note: several backward passes] in zero/reducer.py).

Every engine run is compared with plain torch on the global batch (fp32: ≤ 1e-5)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from parity import global_batches, make_model, rank_slice

import shardspeed
from harness import RankFailure

EXAMPLES = Path(__file__).parents[1] / "fixtures" / "examples"
SLOW = pytest.mark.slow  # the default suite runs a representative subset; the whole matrix under -m slow
MB, LR = 2, 0.05


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"shardspeed_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


gan = _load("gan_deepspeed_train")


def _config(stage: int, gas: int = 1, optimizer: str = "sgd", **zero) -> dict:
    params = {"lr": LR, "momentum": 0.9} if optimizer == "sgd" else {"lr": LR / 10}
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD" if optimizer == "sgd" else "AdamW", "params": params},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50, **zero},
        "steps_per_print": 1000,
    }


def _reference(batches: list, optimizer: str = "sgd", gas: int = 1) -> dict[str, torch.Tensor]:
    model = make_model()
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR / 10)
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_close(got: dict, want: dict, tol: float = 1e-5) -> None:
    for name, value in want.items():
        assert (got[name].float() - value).abs().max().item() <= tol, name


# --- loss.backward() ---------------------------------------------------------------------------------------------
def _train(rank: int, world: int, stage: int, gas: int, mode: str, extra: dict) -> dict:
    model = make_model()
    config = _config(stage, gas, **extra)
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batches = global_batches(3, MB * gas * world)
    for x, y in batches:
        for m in range(gas):
            loss = F.mse_loss(engine(rank_slice(x, m, rank, world, MB)), rank_slice(y, m, rank, world, MB))
            if mode == "engine":
                engine.backward(loss)
            elif mode == "scale":
                engine.scale(loss).backward()
            else:
                loss.backward()
            engine.step()
    out = {n: v.float().clone() for n, v in engine.module_state_dict().items()}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [pytest.param(0, marks=SLOW), 1, pytest.param(2, marks=SLOW), 3])
def test_loss_backward_matches_engine_backward_and_torch_with_gas(dist_run, stage: int) -> None:
    """``loss.backward()`` at GAS 2: the outputs' hooks apply 1/GAS, the boundary backward reduces; the same
    parameters as ``engine.backward(loss)`` and as plain torch on the global batch."""
    want = _reference(global_batches(3, MB * 2 * 2))
    direct = dist_run(_train, 2, stage, 2, "loss", {})
    for r in direct:
        _assert_close(r, want)
    if stage in (0, 3):
        for r in dist_run(_train, 2, stage, 2, "scale", {}):
            _assert_close(r, want)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_loss_backward_with_offload_optimizer(dist_run, stage: int) -> None:
    """Under ``offload_optimizer`` (CPU Adam on host copies) ``loss.backward()`` gives what ``engine.backward``
    gives (≤ 1e-6, as the offload tests compare), and both follow plain torch's AdamW (≤ 1e-4: CPU Adam's
    arithmetic differs from torch's in the last bits, amplified by Adam's normalization)."""
    extra = {"optimizer": "adamw", "offload_optimizer": {"device": "cpu"}}
    want = _reference(global_batches(3, MB * 2 * 2), "adamw")
    engine_runs = dist_run(_train, 2, stage, 2, "engine", extra)
    for direct, explicit in zip(dist_run(_train, 2, stage, 2, "loss", extra), engine_runs):
        _assert_close(direct, explicit, 1e-6)
        _assert_close(direct, want, 1e-4)


def _fp16_plain_backward(rank: int, world: int, stage: int) -> str:
    model = make_model()
    config = {**_config(stage), "fp16": {"enabled": True, "initial_scale_power": 4}}
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = global_batches(1, MB * world)[0]
    rows = slice(rank * MB, (rank + 1) * MB)
    loss = F.mse_loss(engine(x[rows].half()).float(), y[rows])
    try:
        loss.backward()
    except RuntimeError as err:
        message = str(err)
    else:
        message = "no error"
    # the failed backward left nothing open: scale() + backward + step work
    loss = F.mse_loss(engine(x[rows].half()).float(), y[rows])
    engine.scale(loss).backward()
    engine.step()
    return message


def test_fp16_plain_loss_backward_asks_for_scale(dist_run) -> None:
    """As DeepSpeed: fp16 needs the loss scale, so a plain ``loss.backward()`` raises naming
    ``engine.scale(loss)``; afterwards ``engine.scale(loss).backward()`` trains."""
    for message in dist_run(_fp16_plain_backward, 2, 2):
        assert "Loss scaling is required" in message and "engine.scale(loss).backward()" in message


# --- several backward passes, zero_grad ----------------------------------------------------------------------------
def _two_backwards(rank: int, world: int, stage: int, clear: str) -> dict:
    """Per step: a throw-away backward, ``clear``, then two backward passes (halves of the micro-batch) and a step:
    equals plain torch on the whole batch. A second engine runs the same without the throw-away backward (the
    memory it holds is the reference)."""
    out = {}
    for run in ("plain", clear):
        model = make_model()
        engine, optimizer, *_ = shardspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_config(stage)
        )
        for x, y in global_batches(3, MB * world):
            xs, ys = rank_slice(x, 0, rank, world, MB), rank_slice(y, 0, rank, world, MB)
            if run != "plain":
                engine(xs * 3).square().mean().backward()
                if run == "engine":
                    engine.zero_grad()
                elif run == "optimizer":
                    optimizer.zero_grad()
                elif run == "optimizer_keep":
                    optimizer.zero_grad(set_to_none=False)
                elif run == "module":
                    model.zero_grad()
                elif run == "module_keep":
                    model.zero_grad(set_to_none=False)
            for half in (slice(0, MB // 2), slice(MB // 2, MB)):
                engine.backward(F.mse_loss(engine(xs[half]), ys[half]) / 2)
            engine.step()
        out[run] = {
            "params": {n: v.float().clone() for n, v in engine.module_state_dict().items()},
            "memory": engine.memory_breakdown(),
        }
        engine.destroy()
    return out


ZERO_GRAD_CASES = [
    (stage, clear)
    for stage in (0, 1, 2, 3)
    for clear in ("engine", "optimizer", "optimizer_keep", "module", "module_keep")
]
ZERO_GRAD_DEFAULT = {(0, "module"), (1, "optimizer"), (2, "module_keep"), (3, "module")}


@pytest.mark.parametrize(
    ("stage", "clear"),
    [pytest.param(*case, marks=() if case in ZERO_GRAD_DEFAULT else SLOW) for case in ZERO_GRAD_CASES],
)
def test_zero_grad_forgets_a_reduced_backward(dist_run, stage: int, clear: str) -> None:
    """A whole boundary backward (reduced across ranks) is forgotten by ``engine.zero_grad()``,
    ``optimizer.zero_grad()`` or the user's ``module.zero_grad()`` (set_to_none True/False); the next two
    backward passes accumulate (the second reduces only its own increment) and the step equals plain torch.
    Model-state memory (``memory_breakdown()``) is what a run without any of it holds."""
    want = _reference(global_batches(3, MB * 2))
    for r in dist_run(_two_backwards, 2, stage, clear):
        _assert_close(r["plain"]["params"], want)
        _assert_close(r[clear]["params"], want)
        assert r[clear]["memory"] == r["plain"]["memory"]


# --- the GAN fixture ---------------------------------------------------------------------------------------------
def _gan_reference(optimizer: str, iterations: int, world: int) -> dict:
    """Plain torch: the fixture's loop on the global batch."""
    netG, netD = gan.build_models(0)
    criterion = torch.nn.BCELoss()
    optD = gan.make_optimizer(optimizer, netD.parameters(), 0.05)
    optG = gan.make_optimizer(optimizer, netG.parameters(), 0.05)
    batch = MB * world
    for i in range(iterations):
        real, noise = gan.global_batch(i, batch)
        netD.zero_grad()
        errD_real = criterion(netD(real), torch.ones(batch))
        errD_real.backward()
        fake = netG(noise)
        errD_fake = criterion(netD(fake.detach()), torch.zeros(batch))
        errD_fake.backward()
        optD.step()
        netG.zero_grad()
        errG = criterion(netD(fake), torch.ones(batch))
        errG.backward()
        optG.step()
    return {"G": dict(netG.state_dict()), "D": dict(netD.state_dict())}


def _gan_rank(rank: int, world: int, argv: list[str]) -> dict:
    return gan.main(argv)


def _run_gan(dist_run, tmp_path: Path, world: int, stage: int, optimizer: str, set_to_none: int = 1) -> list:
    config = tmp_path / f"ds_{stage}.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": MB,
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "allgather_bucket_size": 40},
                "steps_per_print": 1000,
            }
        )
    )
    argv = ["--deepspeed_config", str(config), "--optimizer", optimizer, "--iterations", "3"]
    return dist_run(_gan_rank, world, [*argv, "--zero_grad_set_to_none", str(set_to_none)])


def _check_gan(results: list, want: dict) -> None:
    for r in results:
        for net in ("G", "D"):
            _assert_close(r[net], want[net])


@pytest.mark.parametrize(
    ("world", "stage", "optimizer"),
    [
        (2, 0, "adam"),
        pytest.param(2, 1, "sgd", marks=SLOW),
        pytest.param(2, 2, "adam", marks=SLOW),
        (2, 3, "sgd"),
        (1, 2, "adam"),
    ],
)
def test_gan_two_engines_match_torch(dist_run, tmp_path: Path, world: int, stage: int, optimizer: str) -> None:
    """DeepSpeedExamples' GAN pattern: the generator's loss flows through the discriminator; its gradients must
    not reach the discriminator's next update (the script's ``netD.zero_grad()`` clears them)."""
    _check_gan(_run_gan(dist_run, tmp_path, world, stage, optimizer), _gan_reference(optimizer, 3, world))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("set_to_none", [0, 1])
def test_gan_matrix(dist_run, tmp_path: Path, world: int, stage: int, optimizer: str, set_to_none: int) -> None:
    _check_gan(_run_gan(dist_run, tmp_path, world, stage, optimizer, set_to_none), _gan_reference(optimizer, 3, world))


# --- the bf16_master_weight fixture --------------------------------------------------------------------------------
bf16_example = _load("bf16_master_weight_train")
BF16_STEPS, BF16_LR = 4, 0.2


def _bf16_rank(rank: int, world: int, argv: list[str]) -> dict:
    return bf16_example.main(argv)


def _bf16_reference(world: int, micro: int) -> dict:
    """Plain torch, bf16 model with fp32 master weights (SGD with momentum on the masters, bf16 copies after each
    step), on the global batch. SGD, not Adam: some gradients here are pure bf16 rounding noise (attention's key
    bias gets an exactly-zero gradient in exact arithmetic), which Adam normalizes into full-size steps of
    either sign, so no two summation orders agree under Adam; under SGD that noise stays noise-sized."""
    args = bf16_example.get_args(["--deepspeed_config", "unused"])
    model = bf16_example.build_model(args).to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.SGD(masters, lr=BF16_LR, momentum=0.9)
    losses = []
    for step in range(BF16_STEPS):
        ids, labels = bf16_example.global_batch(step, micro * world, args)
        loss = torch.nn.functional.cross_entropy(model(ids).view(-1, args.vocab_size).float(), labels.view(-1))
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().float() for n, p in model.named_parameters()}}


def _run_bf16(dist_run, tmp_path: Path, world: int, stage: int) -> list:
    config = tmp_path / "bf16.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": MB,
                "bf16": {"enabled": True},
                "optimizer": {"type": "SGD", "params": {"lr": BF16_LR, "momentum": 0.9}},
                "zero_optimization": {"stage": stage},
                "steps_per_print": 1000,
            }
        )
    )
    return dist_run(_bf16_rank, world, ["--deepspeed_config", str(config), "--num_steps", str(BF16_STEPS)])


BF16_PARAM_TOL = 2**-7  # relative: bf16 keeps 8 significant bits; the ranks' bf16 gradients are summed in a
# different order (and travel in bf16) than the single process's, so a master can round to the neighbouring
# bf16 value; a parameter then differs by at most about one bf16 step of its magnitude
BF16_LOSS_TOL = 1e-2


@pytest.mark.parametrize("stage", [pytest.param(s, marks=SLOW) for s in (0, 1, 2)] + [3])
def test_bf16_master_weight_example_with_loss_backward(dist_run, tmp_path: Path, stage: int) -> None:
    """DeepSpeedExamples' bf16_master_weight API use (``loss.backward()``, ``model_engine.step()``) at every stage:
    a bf16 model with fp32 masters tracks plain torch's bf16 + fp32-master training as closely as bf16 allows."""
    want = _bf16_reference(2, MB)
    initial = {
        n: p.detach().float()
        for n, p in bf16_example.build_model(bf16_example.get_args(["--deepspeed_config", "x"]))
        .to(torch.bfloat16)
        .named_parameters()
    }
    moved = max((want["params"][n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 5e-3
    _assert_tracks_bf16_reference(_run_bf16(dist_run, tmp_path, 2, stage), want, BF16_PARAM_TOL)


def _assert_tracks_bf16_reference(results: list, want: dict, param_tol: float) -> None:
    """Mean of the ranks' losses (each rank's own rows) within ``BF16_LOSS_TOL`` of the reference's; every bf16
    weight within ``param_tol`` of its magnitude (plus 1e-3 near zero)."""
    mean_losses = [sum(step) / len(results) for step in zip(*(r["losses"] for r in results))]
    assert mean_losses == pytest.approx(want["losses"], rel=BF16_LOSS_TOL)
    for r in results:
        assert r["dtype"] == "torch.bfloat16"
        for name, value in want["params"].items():
            bound = param_tol * value.abs() + 1e-3
            assert bool(((r["params"][name] - value).abs() <= bound).all()), name


def _bf16_full_reference(world: int, micro: int) -> dict:
    """Plain torch for the example's ``bf16_full.json``: a bf16 model stepped directly (SGD momentum buffers in
    bf16: no fp32 master, no fp32 state), its forward under ``torch.autocast(bfloat16)``."""
    args = bf16_example.get_args(["--deepspeed_config", "unused"])
    model = bf16_example.build_model(args).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=BF16_LR, momentum=0.9)
    losses = []
    for step in range(BF16_STEPS):
        ids, labels = bf16_example.global_batch(step, micro * world, args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, args.vocab_size).float(), labels.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().float() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("stage", [pytest.param(s, marks=SLOW) for s in (0, 1, 2)] + [3])
def test_bf16_master_weight_example_with_its_bf16_full_config(dist_run, tmp_path: Path, stage: int) -> None:
    """The example's low-precision config (``bf16_master_weights_and_grads`` + ``bf16_optimizer_states`` +
    ``torch_autocast``) through the same script, only the import changed: tracks plain torch's bf16 training
    under autocast as closely as bf16 allows (the ranks' bf16 gradients are summed in another order)."""
    config = tmp_path / "bf16_full.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": MB,
                "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"},
                "optimizer": {"type": "SGD", "params": {"lr": BF16_LR, "momentum": 0.9}},
                "zero_optimization": {"stage": stage},
                "steps_per_print": 1000,
            }
        )
    )
    want = _bf16_full_reference(2, MB)
    results = dist_run(_bf16_rank, 2, ["--deepspeed_config", str(config), "--num_steps", str(BF16_STEPS)])
    _assert_tracks_bf16_reference(results, want, BF16_FULL_PARAM_TOL)


BF16_FULL_PARAM_TOL = 2 * 2**-7  # no fp32 master absorbs rounding: a step's bf16 update can land one bf16 step
# away when the ranks' gradient sums round differently, and those steps add up (measured after 4 steps: within
# two bf16 steps of the weight's magnitude at every stage; one is not enough)


# --- misuse: asymmetric clearing, a backward that raised --------------------------------------------------------------
def _asymmetric_clear(rank: int, world: int, stage: int, how: str) -> str:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    x, y = global_batches(1, MB * world)[0]
    rows = slice(rank * MB, (rank + 1) * MB)
    engine.backward(F.mse_loss(engine(x[rows]), y[rows]))  # reduced: every rank holds the agreed gradient
    if rank == 0:
        model.zero_grad() if how == "module" else engine.zero_grad()
    try:
        engine.step()
    except RuntimeError as err:
        return str(err)
    return "stepped"


@pytest.mark.parametrize(("stage", "how"), [(0, "module"), pytest.param(3, "engine", marks=SLOW)])
def test_clearing_on_one_rank_only_is_an_error_on_every_rank(dist_run, stage: int, how: str) -> None:
    """Rank 0 zeroes the reduced gradients, rank 1 keeps them: every rank raises at the step (no hang, no silent
    divergence)."""
    for message in dist_run(_asymmetric_clear, 2, stage, how):
        assert "gradients were cleared" in message and "between 0 and 1 times" in message


def _backward_raises(rank: int, world: int, stage: int) -> dict:
    """A ``loss.backward()`` that raises midway (a hook on an activation) leaves nothing open: the next backward
    and step train like plain torch on the later batches."""
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    batches = global_batches(3, MB * world)
    x, y = batches[0]
    rows = slice(rank * MB, (rank + 1) * MB)

    def boom(grad: torch.Tensor) -> None:
        raise ValueError("boom")

    def watch(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(boom)

    hidden = engine.module.mid.register_forward_hook(watch)
    message = ""
    try:
        F.mse_loss(engine(x[rows]), y[rows]).backward()
    except ValueError as err:
        message = str(err)
    hidden.remove()
    engine.zero_grad()
    for x, y in batches:
        F.mse_loss(engine(x[rows]), y[rows]).backward()
        engine.step()
    return {"message": message, "params": {n: v.float() for n, v in engine.module_state_dict().items()}}


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=SLOW)])
def test_loss_backward_that_raised_is_cleaned_up(dist_run, stage: int) -> None:
    """Alone, a script may catch a failed ``loss.backward()`` (an out-of-memory error, say), clear and go on."""
    want = _reference(global_batches(3, MB))
    for r in dist_run(_backward_raises, 1, stage):
        assert r["message"] == "boom"
        _assert_close(r["params"], want)


def test_loss_backward_that_raised_beside_peers_is_an_error_on_every_rank(dist_run) -> None:
    """With data-parallel peers it may not: they launched that pass's reductions and wait for this rank's half, so
    the engine refuses to go on (and, unagreed, the error reaches every rank) instead of pairing reductions one pass
    off ([Note: failure propagation])."""
    with pytest.raises(RankFailure) as failure:
        dist_run(_backward_raises, 2, 2)
    assert sorted(failure.value.errors) == [0, 1]
    for message in failure.value.messages():
        assert "raised on this rank before its gradients were reduced" in message or "failed in engine.zero_grad()" in (
            message
        ), message


class _Checkpointed(torch.nn.Module):
    """The parity model with its middle layers under torch's activation checkpointing. Reentrant: the
    recomputation and its backward run as a nested graph task inside the outer one. ``lora_like``: most weights
    frozen (``inp.bias``, ``mid.weight``: trainable parameters beside frozen ones in one module, as LoRA leaves
    them)."""

    def __init__(self, reentrant: bool, lora_like: bool = False) -> None:
        super().__init__()
        self.net = make_model(frozen=lora_like)
        if lora_like:
            self.net.mid.weight.requires_grad_(False)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        net = self.net
        h = torch.tanh(net.inp(x))
        h = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(net.mid2(torch.tanh(net.mid(t)))), h, use_reentrant=self.reentrant
        )
        return net.out(h)


def _reentrant(rank: int, world: int, stage: int) -> dict:
    model = _Checkpointed(reentrant=True)
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    rows = slice(rank * MB, (rank + 1) * MB)
    for x, y in global_batches(3, MB * world):
        F.mse_loss(engine(x[rows]), y[rows]).backward()
        engine.step()
    return {n.removeprefix("net."): v.float() for n, v in engine.module_state_dict().items()}


@pytest.mark.parametrize("stage", [2, pytest.param(0, marks=SLOW), pytest.param(1, marks=SLOW)])
def test_loss_backward_under_reentrant_checkpointing(dist_run, stage: int) -> None:
    """The pass ends when the outer graph task does, not when the first nested one (the recomputation) ends."""
    want = _reference(global_batches(3, MB * 2))
    for r in dist_run(_reentrant, 2, stage):
        _assert_close(r, want)


# --- in combination: loss.backward() + module.zero_grad() + frozen weights + non-reentrant checkpointing --------
def _combined_rank(rank: int, world: int, stage: int, gas: int) -> dict:
    model = _Checkpointed(reentrant=False, lora_like=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = shardspeed.initialize(model=model, model_parameters=trainable, config=_config(stage, gas))
    for x, y in global_batches(3, MB * gas * world):
        model.zero_grad()  # the script's own zeroing, as a plain torch loop writes it
        for m in range(gas):
            F.mse_loss(engine(rank_slice(x, m, rank, world, MB)), rank_slice(y, m, rank, world, MB)).backward()
            engine.step()
    out = {n: v.float().clone() for n, v in engine.module_state_dict().items()}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [pytest.param(s, marks=SLOW) for s in (0, 1, 2)] + [3])
def test_loss_backward_with_frozen_weights_and_checkpointing(dist_run, stage: int) -> None:
    """The combination a PEFT script trains with: ``loss.backward()`` at GAS 2, the module's own ``zero_grad()``
    before each step, frozen parameters beside trainable ones, non-reentrant activation checkpointing. Equal to
    plain torch on the global batch (≤ 1e-5), frozen weights untouched."""
    model = _Checkpointed(reentrant=False, lora_like=True)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    for x, y in global_batches(3, MB * 2 * 2):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    initial = {n: p.detach().clone() for n, p in _Checkpointed(reentrant=False, lora_like=True).named_parameters()}
    assert not torch.equal(want["net.mid2.weight"], initial["net.mid2.weight"])  # the run trains something
    for got in dist_run(_combined_rank, 2, stage, 2):
        _assert_close(got, want)
        for frozen in ("net.inp.bias", "net.mid.weight"):
            assert torch.equal(got[frozen], initial[frozen]), frozen


def test_loss_backward_follows_set_train_batch_size() -> None:
    """``set_train_batch_size()`` changes GAS; ``loss.backward()``'s 1/GAS (applied by the forward outputs' hooks)
    must follow it, as ``engine.backward(loss)``'s does: both give the parameters of plain torch on the batch."""
    batches = global_batches(2, MB * 2)
    results = []
    for mode in ("engine", "loss"):
        model = make_model()
        engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(0))
        engine.set_train_batch_size(MB * 2)  # GAS 1 → 2
        for x, y in batches:
            for m in range(2):
                loss = F.mse_loss(engine(rank_slice(x, m, 0, 1, MB)), rank_slice(y, m, 0, 1, MB))
                engine.backward(loss) if mode == "engine" else loss.backward()
                engine.step()
        results.append({n: v.detach().clone() for n, v in engine.module_state_dict().items()})
        engine.destroy()
    want = _reference(batches)
    for got in results:
        _assert_close(got, want)
