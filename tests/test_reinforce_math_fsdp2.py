"""SCRIPT (REINFORCE on MATH, FSDP2): strict-format grading, the loss against naive references, and the real
script under `torchrun --nproc_per_node=2` (gloo, FSDP2 on CPU) against a real vllm_sync_server (the toy model,
MATH-schema problems whose answer is always 7). A copy of the script is tested by changing SCRIPT."""

import atexit
import contextlib
import functools
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from conftest import (
    CHECKPOINT_ROOTS,
    FIXTURES,
    GRADE_WORKERS,
    PY,
    ROOT,
    assert_seed_streams_distinct,
    free_port,
    help_imports,
    import_script,
    load_behind,
    load_weights,
    logprob_gap,
    max_abs_diff,
    metrics_of,
    naive_advantages,
    other_weights,
    read_jsonl,
    run_changed_behind,
    server_matches,
    server_version,
    stopped_by_the_check,
)

SCRIPT = "reinforce_math_fsdp2.py"
R = import_script(SCRIPT)
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")


def test_strict_format_grading(monkeypatch):
    sol = r"We get $\frac{3}{6} + \frac{2}{6} = \boxed{\frac{5}{6}}$."
    cases = [
        (r"<think>3/6 + 2/6</think> The answer is $\boxed{\frac{5}{6}}$.", (1.0, True, False)),  # well-formed
        (r"<think>add them</think>\boxed{\frac{5}{6}}", (1.0, True, False)),  # a bare box after </think>
        (r"<think>so \boxed{\frac{5}{6}}</think> done.", (0.0, False, True)),  # box only inside the thinking
        (r"<think>so it is \boxed{\frac{5}{6}}", (0.0, False, True)),  # missing </think>
        (r"The answer is \boxed{\frac{5}{6}}.", (0.0, False, True)),  # no think at all
        (r"<think>x</think> \boxed{\dfrac{5}{6}}", (1.0, True, False)),  # nested braces, \dfrac
        (r"<think>x</think> \boxed{5/6} or rather \boxed{6/5}", (0.0, False, False)),  # two boxes: the last counts
        (r"<think>x</think> \boxed{6/5} or rather \boxed{5/6}", (1.0, True, False)),
        (r"<think>x</think> no box here", (0.0, False, True)),
    ]
    for text, want in cases:
        assert tuple(R.grade(text, sol)) == want, text
    assert R.grade(r"<think></think>\boxed 6", r"so the answer is $\boxed 6$.").correct  # `\boxed 6` gold
    assert R.grade(r"<think></think>\boxed{(-2,2)}", "(-2, 2)").correct  # MATH-500's bare `answer` as gold
    monkeypatch.setattr(R, "STRICT_FORMAT", False)  # a copier's TASK without the R1 format: the last box anywhere
    assert R.grade(r"\boxed{\frac{5}{6}}", sol).correct and R.grade(r"<think>x</think> \boxed{5/6}", sol).correct


def test_reinforce_loss_and_advantages_against_naive():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g) * 2
    adv = torch.tensor([0.5, -1.0, 2.0])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    want = -sum(adv[b].item() * lp[b, t].item() for b in range(3) for t in range(5) if mask[b, t]) / mask.sum().item()
    assert abs(R.reinforce_loss(lp, adv, mask).item() - want) < 1e-6
    # the step's divisor (update_policy's: every rank's tokens, fed or not) in place of this batch's token count
    assert abs(R.reinforce_loss(lp, adv, mask, divisor=20.0).item() - want * mask.sum().item() / 20) < 1e-6
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    for scale in (True, False):
        want = torch.tensor(naive_advantages(r.tolist(), 4, scale))
        assert torch.allclose(R.group_advantages(r, 4, scale), want, atol=1e-6)


def synthetic_step() -> tuple[list, torch.Tensor]:
    """A step's 16 samples without a server (4 groups of 4): random prompts of 3-8 tokens, completions of 2-12 (some
    cut by the length limit), and rewards equal within the first two groups (advantages 0), varied in the others."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for p in range(4):
        prompt = torch.randint(1, 300, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for j in range(4):
            n = int(torch.randint(2, 13, (1,), generator=g))
            completion = {
                "token_ids": torch.randint(1, 300, (n,), generator=g).tolist(),
                "logprobs": (-torch.rand(n, generator=g) * 4).tolist(),
                "finish_reason": "length" if n == 12 else "stop",
                "versions": [0],
            }
            samples.append(R.Sample("What is 3 + 4?", "7", prompt, completion, 100 * p + j))
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [1.0, 0.0, 0.0, 1.0] + [0.0, 1.0, 1.0, 0.0])  # [B]
    return samples, rewards


def _update_on_rank(rank, world_size, port, model_dir, out, feed_all):
    """One rank of test_samples_not_fed_change_no_step_on_any_rank (spawned): the script's update of its share of
    synthetic_step's samples (rank r: groups 2r and 2r + 1 of 2 ranks; all 4 alone), every sample fed if `feed_all`.
    Rank 0 writes the step's statistics, the samples it fed and the weights after an SGD step of lr 1 to `out`."""
    import torch.distributed as dist
    import tyro

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    samples, rewards = synthetic_step()
    share = len(samples) // world_size
    samples, rewards = samples[rank * share : (rank + 1) * share], rewards[rank * share : (rank + 1) * share]
    flags = ["--group-size", "4", "--max-completion-tokens", "12", "--micro-token-budget", "48"]
    args = tyro.cli(R.Args, args=[*flags, "--mask-truncated-completions"])
    advantages = R.group_advantages(rewards, args.group_size, args.scale_rewards)  # [B / world_size]
    batch = R.make_batch(samples, rewards, advantages, args)
    if feed_all:
        batch = batch._replace(fed=list(range(share)))
    model = R.setup_model(model_dir, "float32", True, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # linear in the gradient (Adam's first step is not)
    stats, bad_pass = R.update_policy(model, optimizer, batch, samples, advantages, args, 0, True, lambda _: None)
    weights = R.full_state_dict(model)  # every rank gathers
    if rank == 0:
        torch.save(
            {"stats": stats, "bad_pass": bad_pass, "fed": batch.fed, "masked": batch.masked, "weights": weights}, out
        )
    dist.barrier()  # no rank leaves the group while another still uses it (gloo aborts the process otherwise)
    dist.destroy_process_group()


def test_samples_not_fed_change_no_step_on_any_rank(tiny_model, tmp_path):
    """make_batch feeds only the samples that can change the gradient: a zero advantage (a group of equal rewards), or
    a completion masked by --mask-truncated-completions, adds 0 to every token's loss. Over 2 ranks (gloo), rank 0's
    two groups have equal rewards, so it feeds nothing and runs rank 1's micro-batches as empty turns (measuring the
    policy on the first); the divisor is
    the tokens of every sample of both ranks. The step equals one process's that feeds all 16 samples: the same
    gradient norm and the same weights (SGD), which the step moved."""
    from transformers import AutoModelForCausalLM

    got = {}
    for name, world_size, feed_all in (("2 ranks, skipped", 2, False), ("1 process, all fed", 1, True)):
        out = str(tmp_path / f"{world_size}.pt")
        torch.multiprocessing.spawn(
            _update_on_rank, args=(world_size, free_port(), tiny_model, out, feed_all), nprocs=world_size
        )
        got[name] = torch.load(out, weights_only=False)
        assert got[name]["bad_pass"] == 0
    skipped, fed = got["2 ranks, skipped"], got["1 process, all fed"]
    assert skipped["fed"] == [] and fed["fed"] == list(range(16))  # rank 0 fed nothing
    assert any(fed["masked"])
    # rank 0 fed nothing, yet measured the policy (entropy, the sampler's check) on its first empty turn
    assert skipped["stats"]["tokens_fed"] > 0 and skipped["stats"]["entropy_sum"] > 0
    g_skip, g_all = skipped["stats"]["grad_norm"], fed["stats"]["grad_norm"]
    assert g_all > 0 and abs(g_skip - g_all) < 1e-5 * g_all, (g_skip, g_all)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    moved = max_abs_diff(fed["weights"], base)
    assert moved > 1e-3 and max_abs_diff(skipped["weights"], fed["weights"]) < 1e-5 * moved


def test_rollout_seeds_are_distinct_by_construction():
    assert_seed_streams_distinct(R)


def test_help_under_torchrun_prints_once_and_fast():
    r = subprocess.run(
        [TORCHRUN, "--nproc_per_node=3", os.path.join(ROOT, SCRIPT), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.count("usage:") == 1 and "--rank0-only-output" in r.stdout
    r, heavy = help_imports(os.path.join(ROOT, SCRIPT), "--help")  # (torchrun itself imports torch; the script not)
    assert r.returncode == 0 and not heavy, heavy
    r = subprocess.run(
        [TORCHRUN, "--nproc_per_node=2", os.path.join(ROOT, SCRIPT), "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and (r.stdout + r.stderr).count("--no-such-flag") >= 1
    assert (r.stdout + r.stderr).count("For full helptext") == 1  # the error is printed once, by rank 0


def test_param_dtype_applies_on_one_rank(tiny_model):
    """One process gets FSDP2's mixed precision too: the lm_head computes in --param-dtype; the master weights and
    their gradients stay fp32. In fp32, the gradients equal plain autograd's on the Hugging Face model (the one-process
    run is the reference of the 2-rank one in test_fsdp2_end_to_end)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 33, 2, 91, 7]])
    at = torch.tensor([1, 2, 3, 4])  # the flat positions whose next token is scored
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
    R.token_logprobs(ref, ids, torch.ones_like(ids), at)[0].sum().backward()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for dtype in ("bfloat16", "float32"):
            model = R.setup_model(tiny_model, dtype, True, torch.device("cpu"))
            seen = []  # the dtype of the lm_head's input, at every call
            model.lm_head.register_forward_hook(lambda mod, inp, out, seen=seen: seen.append(inp[0].dtype))
            model.token_logprobs(ids, torch.ones_like(ids), at)[0].sum().backward()
            assert seen and set(seen) == {getattr(torch, dtype)}, (dtype, seen)
            assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        assert max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()) < 1e-6
    finally:
        dist.destroy_process_group()


def _setup_on_rank(rank, port, model_dir, out):
    """One rank of test_setup_loads_on_rank0_and_shards_the_checkpoint (spawned)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    loads = []
    from_pretrained = AutoModelForCausalLM.from_pretrained
    AutoModelForCausalLM.from_pretrained = lambda *a, **k: loads.append(a) or from_pretrained(*a, **k)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = R.setup_model(model_dir, "float32", True, torch.device("cpu"))
    got = {
        "loads": len(loads),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "shards": {n: p.to_local().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }
    ids = torch.tensor([[5, 17, 33, 2, 91, 7], [44, 8, 120, 7, 9, 3]])
    with torch.no_grad():
        got["logprobs"] = model.token_logprobs(ids, torch.ones_like(ids), torch.arange(10))[0]
    torch.save(got, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_setup_loads_on_rank0_and_shards_the_checkpoint(tiny_model, tmp_path):
    """2 ranks (gloo): rank 0 alone reads the checkpoint; right after setup every rank holds its shard of the
    checkpoint's weights (dim 0, in rank order), the rotary buffers, and one tied embedding; the logprobs of both
    ranks equal those of the plain Hugging Face model."""
    from transformers import AutoModelForCausalLM

    torch.multiprocessing.spawn(_setup_on_rank, args=(free_port(), tiny_model, str(tmp_path)), nprocs=2)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
    ids = torch.tensor([[5, 17, 33, 2, 91, 7], [44, 8, 120, 7, 9, 3]])
    with torch.no_grad():
        want = R.token_logprobs(ref, ids, torch.ones_like(ids), torch.arange(10))[0]
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [g["loads"] for g in got] == [1, 0] and all(g["tied"] for g in got)
    full = dict(ref.named_parameters())
    for n, p in full.items():
        assert all(torch.equal(g["shards"][n], p.detach().chunk(2)[r]) for r, g in enumerate(got)), n
    assert all(torch.equal(g["buffers"][n], b) for g in got for n, b in ref.named_buffers())
    assert all((g["logprobs"] - want).abs().max().item() < 1e-6 for g in got)


def test_setup_turns_dropout_off_and_refuses_a_model_that_changes_its_logits(tiny_model, tmp_path):
    """A model with attention dropout 0.3, in training mode after setup_model (activation checkpointing needs it),
    gives the same logprobs twice: dropout is off. One whose config soft-caps its logits (Gemma 2's
    final_logit_softcapping) is refused before its weights load, naming the setting: token_logprobs computes
    lm_head(hidden) itself and would not get its logprobs."""
    import torch.distributed as dist

    models = {}
    for name, setting in (("dropout", {"attention_dropout": 0.3}), ("capped", {"final_logit_softcapping": 30.0})):
        models[name] = tmp_path / name
        shutil.copytree(tiny_model, models[name])
        config = json.loads((models[name] / "config.json").read_text())
        (models[name] / "config.json").write_text(json.dumps({**config, **setting}))
    ids = torch.tensor([[5, 17, 33, 2, 91, 7, 44, 8, 120]])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = R.setup_model(str(models["dropout"]), "float32", True, torch.device("cpu"))
        assert model.training
        torch.manual_seed(0)
        first, second = (model.token_logprobs(ids, torch.ones_like(ids), torch.arange(8))[0] for _ in range(2))
        assert torch.equal(first, second)
        with pytest.raises(SystemExit, match="changes its logits after the lm_head .final_logit_softcapping=30.0"):
            R.setup_model(str(models["capped"]), "float32", True, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# the real script against the real server (conftest's `toy`: the toy model's server, one for this module)
@functools.cache
def lenient_script() -> str:
    """SCRIPT as a copier who rewards the last box anywhere edits it (its TASK's STRICT_FORMAT = False), in a folder of
    its own (removed at exit), where its grading workers import it: the toy model (and SmolLM2 on arithmetic) writes
    no think block, so under the R1 format every reward would be 0 and no run would learn."""
    text = Path(ROOT, SCRIPT).read_text()
    assert text.count("\nSTRICT_FORMAT = True ") == 1
    folder = tempfile.mkdtemp(prefix="lenient_")
    atexit.register(shutil.rmtree, folder, True)
    Path(folder, SCRIPT).write_text(text.replace("\nSTRICT_FORMAT = True ", "\nSTRICT_FORMAT = False ", 1))
    return os.path.join(folder, SCRIPT)


def script_args(url, model, *extra, lr="1e-4", data=None, eval_data=None) -> list:
    """The script (its lenient copy) and its arguments against the server at `url` (fp32), for a launcher to run.
    `data` and `eval_data`: the training and evaluation sets (default: the toy math set for both, its overlap kept)."""
    toy_data = data is None
    data = data or os.path.join(FIXTURES, "math_toy")
    return [
        lenient_script(),
        "--model",
        model,
        "--dataset",
        data,
        "--eval-dataset",
        eval_data or data,
        "--vllm-port",
        url.rsplit(":", 1)[1],
        "--max-completion-tokens",
        "16",
        "--group-size",
        "8",
        "--learning-rate",
        lr,
        "--system-prompt",
        "",
        "--param-dtype",
        "float32",
        "--micro-token-budget",
        "64",
        "--eval-every",
        "0",
        "--save-every",
        "1",
        *(["--keep-eval-overlap"] if toy_data else []),  # the toy set's test problems are among its training problems
        *GRADE_WORKERS,
        *extra,
    ]


def run(url, model, workdir, *extra, nproc=2, lr="1e-4", nodes=1, data=None, eval_data=None, env=None):
    """The script under torchrun (`nproc` ranks per node; 0: plain python) in `workdir`. nodes > 1: one launcher per
    "node" on this machine, all in `workdir` (a shared filesystem), meeting at a c10d rendezvous as on a cluster.
    `data` and `eval_data`: as script_args; `env`: the launchers' environment (None: this one's). Returns the
    launchers' stdout and stderr together, and the metrics (one dict per step)."""
    launch = [[TORCHRUN, f"--nproc_per_node={nproc}"] if nproc else [PY]]
    if nodes > 1:
        rdzv = f"127.0.0.1:{free_port()}"
        launch = [
            [
                TORCHRUN,
                f"--nnodes={nodes}",
                f"--node-rank={n}",
                f"--nproc-per-node={nproc}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv}",
            ]
            for n in range(nodes)
        ]
    cmd = script_args(url, model, *extra, lr=lr, data=data, eval_data=eval_data)
    os.makedirs(workdir, exist_ok=True)
    with contextlib.ExitStack() as files:  # the launchers' output goes to files: no pipe fills up
        outs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in launch]
        errs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in launch]
        procs = [
            subprocess.Popen(prefix + cmd, cwd=workdir, stdout=out, stderr=err, text=True, env=env)
            for prefix, out, err in zip(launch, outs, errs, strict=True)
        ]
        codes = [p.wait(timeout=900) for p in procs]
        stdout = "".join(f.seek(0) or f.read() for f in outs)
        stderr = "".join(f.seek(0) or f.read() for f in errs)
    assert codes == [0] * len(procs), stdout[-3000:] + stderr[-6000:]
    return stdout + stderr, metrics_of(stdout)


CKPT = "checkpoints_math_fsdp2"  # the script's default checkpoint directory


def rollout_log(path, rank: int) -> list[dict]:
    """The rollout log rank `rank` of the run in `path` wrote (each rank writes its own)."""
    return read_jsonl(path / f"fsdp2_math_rollouts.rank{rank}.jsonl")


class FsdpRun(NamedTuple):
    path: Path
    out: str  # the launcher's stdout and stderr
    metrics: list[dict]
    rollouts: list[list[dict]]  # per rank, read before test_resume_continues_from_the_sharded_state appends to them
    checkpoints: list[str]  # the checkpoint directories, listed before that test adds step_3
    server_matched_step_2: bool  # the server held exactly step 2's weights when the run ended


@pytest.fixture(scope="module")
def fsdp_run(toy, tmp_path_factory) -> FsdpRun:
    """The 2-rank run of test_fsdp2_end_to_end, also the reference of the tests that compare its first step: 2 ranks x
    4 prompts x 8 completions, fp32 policy, several micro-batches per rank (gradient sync only on the last), activation
    checkpointing on (the default), every push verified against the server's checksums.
    test_resume_continues_from_the_sharded_state resumes it to step 3 (steps 1 and 2 stay): what that changes (the
    rollout logs, the checkpoints, the server's weights) is read here, right after the run."""
    path = tmp_path_factory.mktemp("fsdp")
    out, m = run(
        toy.url,
        toy.model,
        path,
        "--train-steps",
        "2",
        "--rollouts-per-update",
        "4",
        "--verify-sync",
        "--eval-every",
        "2",
        "--eval-limit",
        "4",
        "--rank0-only-output",
    )
    return FsdpRun(
        path=path,
        out=out,
        metrics=m,
        rollouts=[rollout_log(path, rank) for rank in (0, 1)],
        checkpoints=sorted(os.listdir(path / CKPT)),
        server_matched_step_2=server_matches(toy.url, path / CKPT / "step_2"),
    )


def step_1(path):
    """Step 1 of the run in `path`: per rank, its rollouts (problem, completion, seed, reward); and the weights."""
    rows = [
        [(x["prompt"], x["completion"], x["seed"], x["reward"]) for x in rollout_log(path, rank) if x["step"] == 1]
        for rank in (0, 1)
    ]
    return rows, load_weights(path / CKPT / "step_1")


def test_fsdp2_end_to_end(fsdp_run):
    """The 2-rank run: a real gradient, the trainer's logprobs equal vLLM's under FSDP2, rank 0 alone prints and
    writes the Hugging Face checkpoint while each rank writes its shards of the trainer state, each rank logs its own
    rollouts, and the server ends with exactly the gathered weights of the last step."""
    path = fsdp_run.path
    out = fsdp_run.out
    m = fsdp_run.metrics
    assert [x["version"] for x in m] == ["1", "2"] and "eval/accuracy" in m[1]
    assert float(m[0]["grad_norm"]) > 0  # rewards varied: a real gradient
    # alignment under FSDP2: the trainer's fp32 logprobs of the sampled tokens equal vLLM's (mean |diff|)
    assert all(float(x["logprob_mismatch"]) < 1e-4 for x in m), [x["logprob_mismatch"] for x in m]
    for x in m:  # the diagnostics, summed over both ranks (the toy model's vocabulary: entropy <= log(128) = 4.852)
        assert 0 < float(x["entropy"]) <= 4.86 and 0 <= float(x["frac_reward_zero_std"]) <= 1, x
        assert 0 <= float(x["completion_truncated_rate"]) <= 1 and float(x["seq_len_truncated_rate"]) == 0, x
    for step, x in enumerate(m, start=1):  # the samples not fed, over both ranks: those of advantage 0 (none masked)
        rows = [r for rank in fsdp_run.rollouts for r in rank if r["step"] == step]
        skipped = sum(r["advantage"] == 0 for r in rows) / len(rows)
        assert float(x["frac_samples_skipped"]) == pytest.approx(skipped, abs=1e-3), (x, skipped)
    assert out.count("done: 2 steps") == 1  # --rank0-only-output: rank 1 printed nothing on stdout
    ck = path / CKPT
    assert fsdp_run.checkpoints == ["step_1", "step_2"]
    # rank 0 alone wrote the Hugging Face checkpoint; each rank wrote its shards of the trainer state
    assert (
        "[rank1] INFO saved" in out
        and len([x for x in os.listdir(ck / "step_2" / "trainer") if x.endswith(".distcp")]) == 2
    )
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ck / "step_2")
    for rank, rows in enumerate(fsdp_run.rollouts):
        assert len(rows) == 2 * 4 * 8 and {x["rank"] for x in rows} == {rank}
    assert fsdp_run.server_matched_step_2  # the server holds exactly the gathered weights of the last step


def test_two_ranks_equal_one_process(toy, fsdp_run, tmp_path):
    """FSDP2 correctness: step 1 on 2 ranks equals step 1 in one process (FSDP over one rank; same prompts, same
    seeds, so the same completions; the loss normalised by the global token count): the same gradient norm and the
    same weights, which the step did move."""
    _, m1 = run(toy.url, toy.model, tmp_path, "--train-steps", "1", "--rollouts-per-update", "8", nproc=0)
    two_ranks = load_weights(fsdp_run.path / CKPT / "step_1")
    one_process = load_weights(tmp_path / CKPT / "step_1")
    base = load_weights(toy.model)
    g_one = float(m1[0]["grad_norm"])
    assert abs(g_one - float(fsdp_run.metrics[0]["grad_norm"])) < 1e-5 * g_one
    # (a small learning rate: Adam's first step, lr * g / (|g| + eps), amplifies float noise where g ~ 0)
    assert max_abs_diff(two_ranks, one_process) < 1e-5
    assert max_abs_diff(two_ranks, base) > 5e-5  # the step moved the weights


def test_resume_continues_from_the_sharded_state(toy, fsdp_run):
    """--resume continues the 2-rank run at step 3 from its sharded state, pushing the checkpoint's weights first;
    every sample of the run, over ranks, steps and the resume, drew its own random stream."""
    path = fsdp_run.path
    out, m3 = run(toy.url, toy.model, path, "--train-steps", "3", "--rollouts-per-update", "4", "--resume")
    assert "resumed from checkpoints_math_fsdp2/step_2 at step 2" in out and [x["version"] for x in m3] == ["3"]
    assert set(os.listdir(path / CKPT)) == {"step_1", "step_2", "step_3"}
    seeds = [x["seed"] for rank in (0, 1) for x in rollout_log(path, rank)]
    assert len(seeds) == 3 * 2 * 4 * 8 and len(set(seeds)) == len(seeds)


def test_resume_says_at_start_what_it_will_not_do(fsdp_run):
    """The 2-rank run's newest checkpoint holds the run's arguments (args.json). Resumed retyping nothing it has
    nothing to do (exit 0); resumed for more steps in one process it is refused at start: the sharded state would
    reshard, but each rank's data share, random streams and rollout log belong to its rank."""
    path = fsdp_run.path
    newest = max(os.listdir(path / CKPT), key=lambda d: int(d[5:]))
    saved = json.loads((path / CKPT / newest / "args.json").read_text())
    assert saved["rollouts_per_update"] == 4 and saved["train_steps"] == int(newest[5:])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}  # plain python: one process
    cmd = [PY, os.path.join(ROOT, SCRIPT), "--resume"]
    r = subprocess.run(cmd, cwd=path, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    r = subprocess.run([*cmd, "--train-steps", "9"], cwd=path, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "written by 2 ranks" in r.stderr, r.stderr[-2000:]


def test_dynamic_sampling_keeps_the_ranks_in_lockstep(toy, tmp_path):
    """--dynamic-sampling over 2 ranks, 2 prompts each a round, 2 steps: every rank draws the same number of rounds (a
    rank short of 2 groups whose rewards differ makes both draw again, up to --max-sampling-rounds 3), its rollout log
    holds every sample it drew, and the metrics count the prompts drawn over both ranks. Each round's prompts follow
    the run's data order across the ranks, every sample its own seed."""
    flags = ("--train-steps", "2", "--rollouts-per-update", "2", "--dynamic-sampling", "--max-sampling-rounds", "3")
    _, m = run(toy.url, toy.model, tmp_path, *flags)
    logs = [rollout_log(tmp_path, rank) for rank in (0, 1)]
    for step, x in enumerate(m, start=1):
        rounds = int(x["sampling_rounds"])
        assert int(x["prompts_drawn"]) == rounds * 2 * 2, x
        rows = [[r for r in log if r["step"] == step] for log in logs]
        assert [len(r) for r in rows] == [rounds * 2 * 8] * 2  # each rank: rounds x 2 prompts x 8 samples
        differ = [
            [len({r["reward"] for r in rank_rows[k : k + 8]}) > 1 for k in range(0, len(rank_rows), 8)]
            for rank_rows in rows
        ]
        for k in range(1, rounds + 1):  # the rounds went on while a rank had fewer than 2 differing groups
            enough = all(sum(d[: 2 * k]) >= 2 for d in differ)
            assert enough == (k == rounds) or (k == rounds == 3 and not enough), (k, rounds, differ)
    assert max(int(x["sampling_rounds"]) for x in m) > 1  # (at --seed 1 step 1 takes 3 rounds, step 2 one)
    seeds = [r["seed"] for log in logs for r in log]
    assert len(set(seeds)) == len(seeds) == sum(int(x["prompts_drawn"]) for x in m) * 8
    first = sorted({r["seed"] for log in logs for r in log if r["step"] == 1})[::8]  # each request's first seed
    assert first == [R.rollout_seed(1, k, 8) for k in range(int(m[0]["prompts_drawn"]))]  # the data order, no gap


def test_resume_continues_the_same_wandb_run(toy, tmp_path):
    """--logger wandb, offline (WANDB_MODE=offline: the run is written under WANDB_DIR, nothing is sent): a run of 1
    step (one process), then --resume to step 2. Both write to the W&B run of the same id, which rank 0's trainer
    state saved with the checkpoint."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    extra = ("--logger", "print,wandb", "--rollouts-per-update", "2")
    run(toy.url, toy.model, tmp_path, *extra, "--train-steps", "1", nproc=0, env=env)
    saved = torch.load(tmp_path / CKPT / "step_1" / "trainer" / "rank0.pt", weights_only=False)["wandb_id"]
    run(toy.url, toy.model, tmp_path, *extra, "--train-steps", "2", "--resume", nproc=0, env=env)
    runs = sorted(p.name for p in (tmp_path / "wandb").iterdir() if p.name.startswith("offline-run-"))
    assert saved and len(runs) == 2 and all(name.endswith(f"-{saved}") for name in runs), (runs, saved)


def test_two_nodes_reducing_every_micro_batch_equal_one_node(toy, fsdp_run, tmp_path):
    """Two torchrun launchers (--nnodes 2, one process each, a c10d rendezvous, one shared directory) with
    --reduce-every-micro-batch (a reduce-scatter after each micro-batch) make step 1 of fsdp_run (2 processes on one
    node, one reduce-scatter after the last micro-batch, the gradients accumulated unsharded meanwhile; fp32, several
    micro-batches per rank): the same samples on the same RANK, the same weights, which the step moved; rank 0 alone
    prints; each rank logs under its RANK, and LOCAL_RANK (the device index on GPUs) is 0 on both nodes."""
    url, model = toy
    out, m = run(
        url,
        model,
        tmp_path,
        "--train-steps",
        "1",
        "--rollouts-per-update",
        "4",
        "--rank0-only-output",
        "--reduce-every-micro-batch",
        nproc=1,
        nodes=2,
    )
    rows, a = step_1(tmp_path)
    ref_rows, b = step_1(fsdp_run.path)
    assert rows == ref_rows and all(len(r) == 4 * 8 for r in rows)  # the same samples, so the same gradient is due
    assert max_abs_diff(a, b) < 1e-5
    assert max_abs_diff(a, load_weights(model)) > 5e-5  # the step moved the weights
    assert out.count("done: 1 steps") == 1 and len(m) == 1
    assert "[rank0] INFO rank 0 of 2, local rank 0" in out and "[rank1] INFO rank 1 of 2, local rank 0" in out
    assert "[rank1] INFO rank 1 of 2, local rank 1" in fsdp_run.out  # the reference: one node, two local ranks
    assert "[rank1] INFO saved" in out and len(os.listdir(tmp_path / CKPT / "step_1" / "trainer")) == 5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_alignment_trainer_logprobs_equal_server_logprobs(toy, temperature):
    """The script's logprobs of sampled tokens (its micro-batches, chunked lm_head, the sampling temperature) equal
    the server's for the same weights, fp32."""
    url, model = toy
    assert logprob_gap(R, url, model, temperature) < 1e-4


def test_logprobs_follow_the_train_temperature(toy, tmp_path):
    """The script wires --train-temperature into its logprobs: one step at 0.7 agrees with the sampler."""
    url, model = toy
    _, m = run(
        url, model, tmp_path, "--train-steps", "1", "--rollouts-per-update", "4", "--train-temperature", "0.7", nproc=0
    )
    assert float(m[0]["logprob_mismatch"]) < 1e-4, m


MATH500 = Path(ROOT).parent / "shared" / "data" / "math500_test.jsonl"  # the real MATH-500, beside the repository


def test_never_trains_on_an_evaluation_problem_and_reshuffles_every_epoch(toy, tmp_path):
    """The default --eval-dataset case on real data: a training set of 12 MATH-schema problems, 4 of them MATH-500's
    (one re-spaced), evaluated on the real MATH-500. The run says it dropped 4, and its first 2 steps of 4 prompts (one
    process) trained on the 8 others, each once: no evaluation problem reached a rollout. Its third step starts the
    second epoch in an order of its own (problem_index), not the first epoch's again."""
    if not MATH500.is_file():
        pytest.skip(f"{MATH500} is absent: the real MATH-500 lives in ../shared/data beside the repository")
    others = read_jsonl(os.path.join(FIXTURES, "math", "train.jsonl"))
    copied = [
        {"problem": r["problem"], "solution": r["solution"]} for r in read_jsonl(MATH500) if len(r["problem"]) < 100
    ]
    copied = copied[:4]
    copied[0]["problem"] = copied[0]["problem"].replace(" ", "  ") + "\n"
    data = tmp_path / "data"
    data.mkdir()
    rows = others[:4] + copied + others[4:]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    evaluation = tmp_path / "math500"
    evaluation.mkdir()
    (evaluation / "test.jsonl").symlink_to(MATH500)
    workdir = tmp_path / "run"
    extra = ["--train-steps", "3", "--rollouts-per-update", "4"]
    out, m = run(toy.url, toy.model, workdir, *extra, nproc=0, data=str(data), eval_data=str(evaluation))
    assert f"training problems: 12 in {data}, 4 of them evaluation problems: dropped" in out and len(m) == 3
    trained = [x["prompt"] for x in rollout_log(workdir, 0)][::8]  # each prompt's group of 8, in the order drawn
    assert len(trained) == 3 * 4 and sorted(trained[:8]) == sorted(r["problem"] for r in others)
    assert trained == [others[R.problem_index(1, position, 8)]["problem"] for position in range(12)]
    assert trained[8:] != trained[:4]  # the second epoch is drawn anew


def test_weights_changed_behind_the_trainer_stop_the_run(toy, tmp_path):
    """Another process loads other weights into the server under the version the trainer pushed last, between its
    push of step 1 and its sampling of step 2 (conftest's run_changed_behind; one process, fp32): step 2 is fresh and
    its logprobs stray from the trainer's, so the run stops there, before step 2's update, naming the step, the
    version, the transport and the figure. (8 prompts a step: step 2 has a group with a gradient, and so tokens fed to
    check; a step that feeds none has no figure, and learns nothing.)"""
    root = CHECKPOINT_ROOTS[toy.url]
    other = other_weights(toy.model, os.path.join(root, "other_fsdp.safetensors"))
    load_behind(toy.url, other, 1000)  # so that version 1 is the trainer's push
    fifo = str(tmp_path / "rollouts.jsonl")
    cmd = [
        PY,
        *script_args(toy.url, toy.model, "--train-steps", "3", "--rollouts-per-update", "8", "--rollout-log", fifo),
    ]
    code, out = run_changed_behind(
        cmd, tmp_path, fifo, pushed=lambda: server_version(toy.url) == 1, change=lambda: load_behind(toy.url, other, 1)
    )
    stop = stopped_by_the_check(out)
    print(stop)
    assert code != 0 and stop is not None, out[-3000:]
    assert stop[:3] == (2, 1, "collective") and stop.limit == 1e-3 and stop.mismatch > 1e-2, stop
    m = metrics_of(out)
    assert [x["version"] for x in m] == ["1"] and float(m[0]["logprob_mismatch"]) < 1e-5, m
    assert os.listdir(tmp_path / CKPT) == ["step_1"]


# ---------------------------------------------------------------------------------------------------
# faults: a preemption, saves cut short, bad data, a budget the server cannot hold
PREEMPT = ("--train-steps", "5", "--save-every", "100", "--rollouts-per-update", "2")  # one save: the last step


class Preempted(NamedTuple):
    stopped: Path  # the run SIGTERMed once step 3 was logged, then resumed to step 5
    code: int  # torchrun's exit status after the SIGTERM
    seconds: float  # from the SIGTERM to torchrun's exit
    said: str  # the stopped run's output
    steps: list[int]  # its complete checkpoints right after the stop
    resumed: str  # the resumed run's output
    straight: Path  # the same 5 steps, never stopped


@pytest.fixture(scope="module")
def preempted(toy, tmp_path_factory) -> Preempted:
    """A 2-rank run of 5 steps, saving at the last only (--save-every 100), SIGTERMed through torchrun (as a cluster's
    preemption) once step 3 is logged. Then, beside its checkpoint, two saves cut short as a kill (or an older version
    of the script, which wrote in place) leaves them: a step_5 whose DCP folder has no metadata and whose model file is
    half there, and a step_6.tmp; the run is resumed to step 5. And the same 5 steps, never stopped."""
    stopped, straight = tmp_path_factory.mktemp("stopped"), tmp_path_factory.mktemp("straight")
    cmd = [TORCHRUN, "--nproc_per_node=2", *script_args(toy.url, toy.model, *PREEMPT)]
    with tempfile.TemporaryFile("w+") as out:  # a file, not a pipe: nothing blocks on a full pipe or a late reader
        proc = subprocess.Popen(cmd, cwd=stopped, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.time() + 600
            while "\nstep 3: " not in (out.seek(0) or out.read()) and proc.poll() is None and time.time() < deadline:
                time.sleep(0.1)
            os.kill(proc.pid, signal.SIGTERM)
            t0 = time.time()
            code = proc.wait(timeout=120)
            seconds = time.time() - t0
        finally:
            proc.kill()
        said = out.seek(0) or out.read()
    ck = stopped / CKPT
    steps = R.checkpoint_steps(str(ck))
    cut = ck / "step_5"
    shutil.copytree(ck / f"step_{steps[-1]}", cut)
    (cut / "trainer" / ".metadata").unlink()
    model_file = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(model_file[: len(model_file) // 2])
    (ck / "step_6.tmp").mkdir()
    resumed, _ = run(toy.url, toy.model, stopped, *PREEMPT, "--resume")
    run(toy.url, toy.model, straight, *PREEMPT)
    return Preempted(stopped, code, seconds, said, steps, resumed, straight)


def test_sigterm_saves_the_step_in_progress_on_every_rank_and_stops(preempted):
    """torchrun forwards the SIGTERM to both ranks; they finish the step in progress, agree to stop, save that step
    (3 or 4: it depends on when the signal lands) in one complete checkpoint and exit with 128 + SIGTERM, well within
    torchrun's 30 s before SIGKILL; torchrun itself then exits 1 (the SignalException it raises)."""
    said = preempted.said
    last = preempted.steps[-1]
    print(f"stopped after step {last}, {preempted.seconds:.1f} s after the SIGTERM")
    assert preempted.code == 1 and preempted.seconds < 60, said[-3000:]
    assert said.count("SIGTERM: the step in progress finishes and is saved, then the run stops") == 2, said[-3000:]
    assert said.count(f"stopped by SIGTERM after step {last}: --resume goes on from there") == 2, said[-3000:]
    assert "forcefully exiting" not in said  # no rank was still running at torchrun's SIGKILL
    assert 3 <= last < 5 and preempted.steps == [last]
    trainer = preempted.stopped / CKPT / f"step_{last}" / "trainer"
    assert {"rank0.pt", "rank1.pt", ".metadata"} <= set(os.listdir(trainer))


def test_sigterm_then_resume_equals_an_uninterrupted_run(preempted):
    """--resume after the SIGTERM goes on from the step saved and reaches step 5 with the prompts, completions and
    seeds of the run never stopped, on each rank, and its weights."""
    last = preempted.steps[-1]
    assert f"resumed from checkpoints_math_fsdp2/step_{last} at step {last}" in preempted.resumed
    for rank in (0, 1):
        rows = [
            [(x["step"], x["prompt"], x["completion"], x["seed"]) for x in rollout_log(path, rank)]
            for path in (preempted.stopped, preempted.straight)
        ]
        assert rows[0] == rows[1] and len(rows[0]) == 5 * 2 * 8
    weights = [load_weights(path / CKPT / "step_5") for path in (preempted.stopped, preempted.straight)]
    assert max_abs_diff(*weights) < 1e-6


def test_resume_skips_saves_cut_short_and_saves_over_them(preempted):
    """The resumed run names the step_5 without DCP metadata and the leftover step_6.tmp in one line each (rank 0
    alone), resumes from the newest complete checkpoint, and its own save of step 5 replaces the one cut short
    (test_sigterm_then_resume_equals_an_uninterrupted_run compares its weights). The leftover stays, ignored."""
    out = preempted.resumed
    for name in ("step_5", "step_6.tmp"):
        said = f"skipped checkpoints_math_fsdp2/{name}: cut short while it was saved (no trainer/.metadata)"
        assert out.count(said) == 1, out[-3000:]
    ck = preempted.stopped / CKPT
    assert R.checkpoint_steps(str(ck)) == [preempted.steps[-1], 5] and (ck / "step_6.tmp").is_dir()
    assert not (ck / "step_5.tmp").exists()


# what a child of the kill test imports beyond this module (transformers imports them lazily): 5-15 s a child under load
CHILD_IMPORTS = [
    f"transformers.models.{m}" for m in ("auto.tokenization_auto", "auto.modeling_auto", "qwen2.modeling_qwen2")
]


def _save_forever(checkpoint_dir: str, model_dir: str, ready) -> None:
    """A child of the forkserver: a one-rank gloo group, the script's FSDP2 model (setup_model) and an AdamW with state
    (lr 0: the weights stay the model's); once ready, what a run does at a step's end, as fast as it can: save step
    N + 1 after the newest complete step N, then prune to the newest 2, and say so on the connection `ready` (one
    message a save). It never returns: the test kills it."""
    import torch.distributed as dist
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    torch.set_num_threads(1)
    transformers_logging.disable_progress_bar()  # (tqdm's semaphore, which a killed child would leave behind)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = R.setup_model(model_dir, "float32", False, torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    ids = torch.tensor([[5, 17, 33, 2, 91]])
    model.token_logprobs(ids, torch.ones_like(ids), torch.arange(4))[0].sum().backward()
    optimizer.step()
    ready.send_bytes(b"!")
    while True:
        steps = R.checkpoint_steps(checkpoint_dir)
        step = (steps[-1] if steps else 0) + 1
        counters = {"step": step, "version": step, "data_pos": step}
        path = os.path.join(checkpoint_dir, f"step_{step}")
        R.save_checkpoint(path, model, tokenizer, optimizer, counters, {"seed": 1}, 0)
        R.prune_checkpoints(checkpoint_dir, 2)
        ready.send_bytes(b".")


def test_a_save_killed_at_any_moment_leaves_a_complete_checkpoint(toy_model, tmp_path):
    """test_faults.py's kill test for FSDP2's save, which needs a process group: 24 SIGKILLs at random moments of a
    loop of saves (most land inside a save: they leave its .tmp folder), each in a fresh child. After each, the newest
    checkpoint checkpoint_steps offers loads whole: the Hugging Face model holds the weights saved, rank0.pt its step,
    and the DCP shards the weights and Adam's moments; once a checkpoint exists one always does (pruning keeps the
    newest); and the next save of a step whose save was cut short succeeds. No race with the machine's speed: the
    first child is killed only after a save has finished, and the moments of the kills are drawn in units of that
    save's measured time. The children come from a forkserver (a fresh process that imported this module once), not
    from pytest's process: a child forked from a process with threads (pytest-xdist's, the grading pools') can inherit
    a lock another thread held, and one did not set up within 120 s."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert not dist.is_initialized()  # the children build their own group
    expected = load_weights(toy_model)
    checkpoint_dir = str(tmp_path / "ckpt")
    os.makedirs(checkpoint_dir)
    rng = random.Random(0)
    mid_save = 0  # kills that left a save's .tmp behind
    save_s = None  # how long one save takes here (the first child's first)
    forkserver = mp.get_context("forkserver")
    forkserver.set_forkserver_preload([__name__, *CHILD_IMPORTS])  # imported once, not in each child
    for kill in range(24):
        ready, ready_w = forkserver.Pipe(duplex=False)
        child = forkserver.Process(target=_save_forever, args=(checkpoint_dir, toy_model, ready_w))
        child.start()
        try:
            assert ready.poll(120) and ready.recv_bytes() == b"!", "the child did not set up within 120 s"
            if save_s is None:  # a complete checkpoint from now on
                t0 = time.time()
                assert ready.poll(120), "no save finished within 120 s"
                save_s = time.time() - t0
            time.sleep(rng.uniform(0.05, 1.5) * save_s)
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.join()
            ready.close()
            ready_w.close()
        mid_save += any(name.endswith(".tmp") for name in os.listdir(checkpoint_dir))
        steps = R.checkpoint_steps(checkpoint_dir)
        assert steps, f"no complete checkpoint after {kill + 1} kills: {os.listdir(checkpoint_dir)}"
        if steps:
            newest = os.path.join(checkpoint_dir, f"step_{steps[-1]}")
            assert max_abs_diff(expected, load_weights(newest)) == 0, newest
            assert torch.load(os.path.join(newest, "trainer", "rank0.pt"), weights_only=False)["step"] == steps[-1]
            dcp_to_torch_save(os.path.join(newest, "trainer"), tmp_path / "dcp.pt")
            state = torch.load(tmp_path / "dcp.pt", weights_only=False)
            assert all(torch.equal(state["model"][k], v) for k, v in expected.items()), newest
            assert all(s["exp_avg_sq"].abs().sum() > 0 for s in state["optim"]["state"].values()), newest
    print(f"{mid_save} of 24 kills landed inside a save")
    assert mid_save >= 8, f"only {mid_save} of 24 kills landed inside a save"


def test_the_math_fixtures_and_the_real_math500_pass_the_checks():
    """Every row of the MATH-schema fixtures, and of the real MATH-500 where ../shared/data has it, passes to_problem's
    checks (a \\boxed{} answer in every solution), which makes it (the problem, the solution's last box)."""
    files = [
        os.path.join(FIXTURES, d, f)
        for d in os.listdir(FIXTURES)
        if d.startswith("math")
        for f in ("train.jsonl", "test.jsonl")
    ]
    files += [str(MATH500)] if MATH500.is_file() else []
    for file in [f for f in files if os.path.isfile(f)]:
        assert all(R.to_problem(r) == (r["problem"], R.last_boxed(r["solution"])) for r in read_jsonl(file)), file
    # MATH's train set has answers boxed without braces
    assert R.to_problem({"problem": "x?", "solution": "so $x = \\boxed 2$."}) == ("x?", "2")
    for solution in ("The answer is 7.", "$\\boxed{}$", "$\\boxed{7$"):
        with pytest.raises(ValueError) as e:
            R.to_problem({"problem": "x?", "solution": solution})
        assert str(e.value) == "'solution' has no \\boxed{} answer", solution


def test_a_bad_row_is_refused_once_under_torchrun(tmp_path):
    """A bad row in the evaluation split (a MATH-500 row whose solution holds no box; its bare `answer` is not read) is
    refused on both ranks before torch is imported, by rank 0 alone in one line: rank 0 exits 2 and torchrun stops
    rank 1 before it says anything."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(os.path.join(FIXTURES, "math_toy", "train.jsonl"), data / "train.jsonl")
    rows = read_jsonl(os.path.join(FIXTURES, "math500", "test.jsonl"))
    rows[1]["solution"] = "Add them: 7."
    (data / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cmd = [TORCHRUN, "--nproc_per_node=2", os.path.join(ROOT, SCRIPT), "--dataset", "data", "--eval-dataset", "data"]
    r = subprocess.run(
        [*cmd, "--model", "/nonexistent/model"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1 and out.count("data/test.jsonl:2: 'solution' has no \\boxed{} answer") == 1, out[-3000:]
    assert "failed (exitcode: 2) local_rank: 0" in out and f'File "{os.path.join(ROOT, SCRIPT)}"' not in out


def test_a_group_of_one_and_no_server_are_refused_once_under_torchrun(tmp_path):
    """Under torchrun (2 ranks), before anything heavy, on every rank and said once (by rank 0), no traceback of the
    script, and no rank left waiting: --group-size 1 (a group of one is its own baseline: its std is NaN) exits 2,
    naming the flag; with good flags and no server at --vllm-port (the newcomer who forgot to start it), the run
    exits 1 naming the URL and how to start one."""
    port = free_port()
    data = os.path.join(FIXTURES, "math_toy")
    cmd = [TORCHRUN, "--nproc_per_node=2", os.path.join(ROOT, SCRIPT), "--dataset", data, "--eval-dataset", data]
    cmd += ["--keep-eval-overlap", "--vllm-port", str(port), *GRADE_WORKERS]
    for extra, code, said in (
        (
            ["--group-size", "1"],
            2,
            "--group-size must be 2 or more (each completion is scored against its group's), got 1",
        ),
        ([], 1, f"no server answers at http://127.0.0.1:{port}: start one (python vllm_sync_server.py --model MODEL"),
    ):
        t0 = time.time()
        r = subprocess.run([*cmd, *extra], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        out = r.stdout + r.stderr
        print(f"{extra}: torchrun exited {r.returncode} after {time.time() - t0:.1f} s")
        assert r.returncode == 1 and out.count(said) == 1, out[-3000:]  # (torchrun's own status: 1)
        assert f"failed (exitcode: {code}) local_rank: 0" in out and f'File "{os.path.join(ROOT, SCRIPT)}"' not in out
        assert time.time() - t0 < 60


def test_a_completion_budget_the_server_cannot_hold_is_refused_at_start(toy, tmp_path):
    """--max-completion-tokens past the server's max_model_len (1024 here) after the longest prompt is refused on
    every rank once the server answers, before the model loads, said once (by rank 0)."""
    cmd = [TORCHRUN, "--nproc_per_node=2", *script_args(toy.url, toy.model, "--max-completion-tokens", "1020")]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    said = "exceeds the server's max_model_len 1024: lower it, or start the server with a larger --max-model-len"
    assert r.returncode == 1 and out.count(said) == 1, out[-3000:]
    assert "--max-completion-tokens 1020 after the longest prompt (" in out and not (tmp_path / CKPT).exists()


GRADER_PIDS = """
import os, signal, sys
import psutil
sys.path.insert(0, sys.argv[1])
import reinforce_math_fsdp2 as R
signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the rank, which turns SIGTERM into a stop
assert R.grade_batch(["<think></think>\\\\boxed{7}"], ["7"], 5.0, workers=2)[0].correct
workers = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
print(" ".join(str(p.pid) for p in workers), flush=True)
sys.stdin.readline()
print(R.grade_batch(["<think></think>\\\\boxed{7}"] * 4, ["7"] * 4, 5.0, workers=2), flush=True)
"""


def test_torchruns_signal_to_a_rank_leaves_its_grading_workers_alone(tmp_path):
    """torchrun signals each rank's whole process group (os.killpg; a rank leads its own session): the grading workers
    leave that group when they start (warm_up_grader), so the SIGTERM a rank turns into a stop does not end the workers
    that grade the step it finishes. They still end with their rank: SIGKILLed, it closes the pipe they read tasks
    from, and they exit."""
    import psutil

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    cmd = [PY, "-c", GRADER_PIDS, ROOT]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(os.getpgid(p) != proc.pid for p in pids), pids
        os.killpg(proc.pid, signal.SIGTERM)  # what torchrun does (subprocess_handler.py)
        time.sleep(1)
        assert all(alive(p) for p in pids)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().count("correct=True") == 4
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's last word, past its grace period: the workers follow the rank
        deadline = time.time() + 30
        while any(alive(p) for p in pids):
            assert time.time() < deadline, "a grading worker outlived its rank"
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
