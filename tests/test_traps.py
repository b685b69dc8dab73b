"""The traps a copier of a trainer falls into, each shut: dropout left on, a model whose forward changes its logits
after the lm_head, a group of one, no server at start, one data order for the whole run, a W&B run that --resume
would open anew, and a later pass of --num-iterations that goes bad. The shared functions are checked in
grpo_gsm8k.py's copy (tests/test_copies.py keeps the others identical); the refusals run the scripts themselves."""

import os
import subprocess

import numpy as np
import pytest
import torch

from conftest import FIXTURES, PY, ROOT, free_port, import_script, run_ok

G = import_script("grpo_gsm8k.py")
GRPO_SCRIPTS = ("grpo_gsm8k.py", "grpo_gsm8k_lora_one_gpu.py")


def test_dropout_is_off_in_the_trained_policy(tiny_model):
    """A model with attention dropout 0.3 in training mode (activation checkpointing needs it): two forwards differ
    (the control), and after disable_dropout they agree with each other and with the model in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attention_dropout=0.3).train()
    ids = torch.tensor([[5, 17, 33, 2, 91, 44, 8, 120]])
    torch.manual_seed(0)
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout is on: the control
    G.disable_dropout(model)
    assert model.training
    first, second = model(ids).logits, model(ids).logits
    assert torch.equal(first, second)
    assert torch.allclose(first, model.eval()(ids).logits, atol=1e-6)


@pytest.mark.parametrize("config", ["Gemma2Config", "CohereConfig", "GraniteConfig"])
def test_a_model_that_changes_its_logits_after_the_lm_head_is_refused(config):
    """Gemma 2 soft-caps its logits, Cohere and Granite scale them: token_logprobs's lm_head shortcut would not give
    the model's logprobs, so check_logits refuses them, naming the setting. A plain Qwen2 passes."""
    import transformers

    cfg = getattr(transformers, config)()
    if config == "GraniteConfig":
        cfg.logits_scaling = 8.0  # its default, 1.0, changes nothing
    with pytest.raises(
        SystemExit, match="changes its logits after the lm_head .(final_logit_softcapping|logit_scale|logits_scaling)="
    ):
        G.check_logits(cfg)
    G.check_logits(transformers.Qwen2Config())


@pytest.mark.parametrize("script", GRPO_SCRIPTS)
def test_a_group_of_one_is_refused(script, tmp_path):
    """--group-size 1: one sample's std is NaN and a group of one has no baseline. Refused at once, exit 2, one line
    naming the flag (before the server is looked for: none runs at this port)."""
    cmd = [PY, os.path.join(ROOT, script), "--group-size", "1", "--vllm-port", str(free_port())]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "--group-size must be 2 or more (each completion is scored against its group's), got 1"


@pytest.mark.parametrize("script", GRPO_SCRIPTS)
def test_no_server_is_named_in_one_line(script, tmp_path):
    """The newcomer who forgot to start the server: one line naming the URL and how to start one, exit 1, no
    traceback, before the model is loaded."""
    port = free_port()
    cmd = [PY, os.path.join(ROOT, script), "--dataset", os.path.join(FIXTURES, "gsm8k_toy"), "--vllm-port", str(port)]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"no server answers at http://127.0.0.1:{port}: start one (python vllm_sync_server.py")


def test_the_data_are_reshuffled_every_epoch():
    """Each epoch draws every problem once, in an order of its own; the first epoch's is the order of earlier versions
    (numpy's default_rng(seed)); the same seed draws the same problems, whatever the run's resumes."""
    n = 10
    drawn = [G.problem_index(3, position, n) for position in range(3 * n)]
    epochs = [drawn[k : k + n] for k in range(0, 3 * n, n)]
    assert all(sorted(epoch) == list(range(n)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] == np.random.default_rng(3).permutation(n).tolist()
    assert [G.problem_index(3, position, n) for position in range(3 * n)] == drawn
    assert [G.problem_index(4, position, n) for position in range(n)] != epochs[0]


def test_a_bad_later_pass_is_logged_as_what_it_is(tiny_model):
    """--num-iterations 2 with a first pass so large that the weights overflow: the second pass's loss is not finite.
    update_policy says so (pass 2), the first pass's update stays, and the warning says that, not "step skipped"."""
    import tyro
    from test_grpo_gsm8k import synthetic_step
    from transformers import AutoModelForCausalLM

    samples, rewards = synthetic_step(vocab_size=384, prompts=2, group=4)
    args = tyro.cli(G.Args, args=["--num-iterations", "2", "--group-size", "4", "--max-completion-tokens", "12"])
    advantages = G.group_advantages(rewards, args.group_size, args.scale_rewards)
    batch = G.make_batch(samples, rewards, advantages, args)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e38)
    _, bad_pass = G.update_policy(model, None, optimizer, batch, samples, advantages, args, 0, None, False)
    assert bad_pass == 2
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())  # pass 1 was applied
    said = G.bad_pass_warning(7, bad_pass, 2, skipped=0)
    assert "step 7, pass 2 of 2" in said and "keeps the updates of the passes before it (1)" in said
    assert "skipped" not in said
    assert G.bad_pass_warning(7, 1, 2, skipped=3).endswith("step skipped (3 so far)")


def test_resume_continues_the_same_wandb_run(toy, tmp_path):
    """--logger wandb, offline (WANDB_MODE=offline: the run is written under WANDB_DIR, nothing is sent): a run of 1
    step, then --resume to step 2. Both write to the W&B run of the same id, which the checkpoint saved."""
    from test_grpo_gsm8k import script_cmd

    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    cmd = script_cmd(toy.url, "--logger", "print,wandb", "--save-every", "1", model=toy.model)
    run_ok([*cmd, "--train-steps", "1"], cwd=tmp_path, timeout=600, env=env)
    saved = torch.load(tmp_path / "ckpt" / "step_1" / "trainer_state.pt", weights_only=False)["wandb_id"]
    run_ok([*cmd, "--train-steps", "2", "--resume"], cwd=tmp_path, timeout=600, env=env)
    runs = sorted(p.name for p in (tmp_path / "wandb").iterdir() if p.name.startswith("offline-run-"))
    assert len(runs) == 2 and all(name.endswith(f"-{saved}") for name in runs), (runs, saved)
