"""SCRIPT (GRPO with a Python tool): its sandbox against hostile code, its turns token in and token out, the tool's
tokens kept out of the loss, and the script end to end: on a tiny model whose tokenizer holds whole code blocks as
single tokens (so that a random policy calls the tool), and briefly on the real model (conftest's `real_model`).

The sandbox's tests run the hostile code through run_python as the trainer does; where a broken sandbox could harm the
test process itself (a kill of the parent), the "trainer" is a child process of the test."""

import http.server
import os
import subprocess
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from conftest import (
    FIXTURES,
    GRADE_WORKERS,
    PY,
    ROOT,
    build_tiny_model,
    import_script,
    metrics_of,
    read_jsonl,
    run_ok,
    start_server,
    stop_server,
)

SCRIPT = "grpo_gsm8k_python_tool.py"
T = import_script(SCRIPT)
TIMEOUT_S = 2.0  # the tool's time limit in these tests


# ---------------------------------------------------------------------------------------------------
# the sandbox: each protection against the code that would break it
def run(code: str, timeout_s: float = TIMEOUT_S, **limits) -> str:
    return T.run_python(textwrap.dedent(code), timeout_s, **limits)


def test_a_plain_call_and_its_errors():
    assert run("print(74 * 7)") == "518\n"
    reply = run("1 / 0")
    assert "ZeroDivisionError" in reply and reply.endswith("[exit status 1]") and T.tool_status(reply) == "error"
    assert "<string>" not in reply  # the traceback starts at the code's own frames: none of the launcher's
    assert T.tool_status(run("print(")) == "error"
    assert T.tool_status(run("print(1)")) == "ok"


def test_an_endless_loop_is_stopped_at_the_time_limit():
    t0 = time.monotonic()
    reply = run("while True:\n    pass")
    assert T.tool_status(reply) == "timeout", reply
    assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + 3
    threads = """
        import threading
        def spin():
            while True:
                pass
        for _ in range(4):
            threading.Thread(target=spin).start()
    """
    assert T.tool_status(run(threads)) == "timeout"  # its CPU time runs faster than the clock: either limit stops it


def processes_with(marker: str) -> list[str]:
    """The processes of this machine whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(pid)
        except OSError:
            pass
    return found


def test_children_left_behind_are_killed_and_processes_are_limited():
    marker = f"left_behind_{os.getpid()}_{time.monotonic_ns()}"
    code = f"""
        import os, subprocess, sys
        for _ in range(3):  # detached from the call's session and process group: only the pid namespace holds them
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "{marker}"], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
        print("started")
    """
    assert run(code).startswith("started")
    deadline = time.monotonic() + 5  # (the kernel reaps a killed pid namespace's processes in its own time)
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(marker) == []
    bomb = """
        import os, time
        n = 0
        try:
            while n < 200:
                if os.fork() == 0:
                    time.sleep(5)
                    os._exit(0)
                n += 1
        except OSError as e:
            print("stopped at", n, e.errno)
    """
    reply = run(bomb, processes=8)
    assert reply.startswith("stopped at"), reply
    assert int(reply.split()[2]) < 8  # the call's own process among the 8


def test_a_large_allocation_fails_inside_the_call():
    reply = run("x = bytearray(2 << 30)\nprint('allocated')", memory_mib=256)
    assert "MemoryError" in reply and "allocated" not in reply
    assert run("x = bytearray(64 << 20)\nprint(len(x))", memory_mib=256) == f"{64 << 20}\n"


def test_a_flood_of_output_is_cut():
    t0 = time.monotonic()
    reply = run("while True:\n    print('x' * 1000)", output_chars=300)
    assert time.monotonic() - t0 < TIMEOUT_S  # the output limit, not the clock, ends it
    assert reply.startswith("x" * 300) and "[output cut at 300 characters]" in reply and len(reply) < 400
    reply = run("print('é' * 5000)", output_chars=100)  # characters, not bytes
    assert reply.startswith("é" * 100) and "[output cut at 100 characters]" in reply


def test_the_environment_and_the_parents_environ_are_out_of_reach(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "secret-key-of-the-trainer")
    code = f"""
        import os
        print(dict(os.environ))
        for pid in ("{os.getpid()}", "{os.getppid()}", "1", "self"):
            try:
                print(pid, open(f"/proc/{{pid}}/environ", "rb").read())
            except OSError as e:
                print(pid, e)
        print("pids seen:", sorted(p for p in os.listdir("/proc") if p.isdigit()))
    """
    reply = run(code)
    assert "secret-key" not in reply and "VLLM_API_KEY" not in reply, reply
    assert reply.count("\n") >= 5 and "pids seen:" in reply
    seen = reply.split("pids seen:")[1]
    assert f"'{os.getpid()}'" not in seen  # (its pid namespace numbers its own few processes from 1)


def test_killing_the_parent_fails():
    """The code kills every pid it can name: its parent, the trainer's (passed in), another process of the trainer's
    user. The trainer is a child process of this test, so that a broken sandbox ends it and not the test."""
    victim = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    trainer = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        import {SCRIPT.removesuffix(".py")} as T
        code = '''
        import os, signal
        for pid in (os.getppid(), {{trainer}}, {victim.pid}, 1):
            try:
                os.kill(pid, signal.SIGKILL)
                print("killed", pid)
            except OSError as e:
                print("refused", pid, e.errno)
        '''.replace("{{trainer}}", str(os.getpid()))
        print(T.run_python(code, 5))
        print("trainer alive")
    """)
    try:
        r = subprocess.run([PY, "-c", trainer], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "trainer alive" in r.stdout, r.stdout + r.stderr
        assert victim.poll() is None, r.stdout
        assert f"killed {victim.pid}" not in r.stdout
    finally:
        victim.kill()
        victim.wait()


def test_a_local_http_server_is_out_of_reach():
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"reached")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert requests.get(f"http://127.0.0.1:{port}/from-the-test", timeout=5).text == "reached"  # it serves
        code = f"""
            import socket, urllib.request
            try:
                print(urllib.request.urlopen("http://127.0.0.1:{port}/from-the-tool", timeout=2).read())
            except OSError as e:
                print("no connection:", e)
            print([i[1] for i in socket.if_nameindex()])
        """
        reply = run(code)
        assert "no connection" in reply and "reached" not in reply, reply
        assert hits == ["/from-the-test"]
    finally:
        server.shutdown()


def test_writing_outside_its_folder_fails(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o777)  # open to anyone: only the sandbox's walls can stop the writes
    targets = [outside / "a", Path(ROOT) / "written_by_the_tool", Path("/tmp") / f"tool_{os.getpid()}", Path("/a")]
    code = f"""
        import os
        for path in {[str(t) for t in targets]!r} + [{os.path.expanduser("~/a")!r}, "/usr/a", "/dev/shm/a"]:
            try:
                open(path, "w").write("x")
                print("wrote", path)
            except OSError as e:
                print("refused", path, e.errno)
        open("mine.txt", "w").write("mine")
        print(open("mine.txt").read(), os.getcwd())
    """
    reply = run(code)
    assert "wrote" not in reply, reply
    assert "mine /work" in reply
    assert not any(t.exists() for t in targets)


def test_the_calls_run_in_parallel():
    """8 calls of 1 s each through a tool pool of 8 workers take about 1 s, not 8."""
    pool = ThreadPoolExecutor(8)
    t0 = time.monotonic()
    replies = list(pool.map(lambda i: run(f"import time\ntime.sleep(1)\nprint({i})", 5), range(8)))
    assert replies == [f"{i}\n" for i in range(8)]
    assert time.monotonic() - t0 < 4


def test_the_start_says_what_holds_and_refuses_an_unisolated_tool(monkeypatch, capsys):
    args = T.Args(tool_timeout_s=2)
    assert T.check_sandbox(args) == T.sandbox_command()
    said = capsys.readouterr().out
    assert "bubblewrap" in said and "no network" in said and "out of sight" in said and "NOT HELD" not in said
    monkeypatch.setattr(T, "sandbox_command", T.plain_command)  # as on a machine without bubblewrap
    with pytest.raises(SystemExit):
        T.check_sandbox(args)
    assert "would reach network and trainer" in capsys.readouterr().err
    assert T.check_sandbox(T.Args(tool_timeout_s=2, tool_unsafe=True)) == T.plain_command()
    assert "NOT HELD: no network, this trainer's processes out of sight" in capsys.readouterr().out
    assert T.check_sandbox(T.Args(max_tool_calls=0)) == []  # no tool: nothing to check
    with pytest.raises(SystemExit):
        T.check_sandbox(T.Args(max_tool_calls=9))


def test_which_fence_runs_code():
    assert T.code_to_run("Let me compute.\n```python\nprint(74 * 7)\n```\n") == "print(74 * 7)\n"
    assert T.code_to_run("```\nx = 2\nprint(x)\n```\n") == "x = 2\nprint(x)\n"  # an untagged block
    assert T.code_to_run("Here is the code:\n```\n") is None  # an untagged fence that opens a block
    assert T.code_to_run("```output\n36\n```\n") is None  # an output block the model wrote itself
    assert T.code_to_run("```python\nprint(1)\n```\nand\n```\n") is None  # the second fence opens a block
    assert T.tool_reply("36\n") == "```output\n36\n```\n" == T.tool_reply("36")
    assert T.tool_reply("") == "```output\n```\n"
    assert "```python\nprint(4 * 9)\n```\n" + T.tool_reply("36") in T.SYSTEM_PROMPT  # the example reads as a call


# ---------------------------------------------------------------------------------------------------
# the tool's tokens are context: out of the loss, its divisor, the entropy and the mismatch
def sample_with_tool_tokens(prompt, model_ids, tool_ids, more_ids, logprob_of):
    """A Sample whose completion is the model's ids, the tool's, the model's again; `logprob_of(i, token)` gives the
    sampler's logprob of completion position i."""
    ids = model_ids + tool_ids + more_ids
    actions = [1] * len(model_ids) + [0] * len(tool_ids) + [1] * len(more_ids)
    completion = {
        "token_ids": ids,
        "logprobs": [logprob_of(i, t) for i, t in enumerate(ids)],
        "actions": actions,
        "finish_reason": "stop",
        "versions": [0],
    }
    return T.Sample("q", "7", prompt, completion, 0)


def reference_logprobs(model, prompt, ids):
    """Per completion token, its logprob and the policy's entropy at its position (a plain fp32 forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, torch.tensor(ids)[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_tools_tokens_are_context_not_actions(tiny_model, loss_type):
    """update_policy's gradient is that of the model's tokens alone, each conditioned on the tool's tokens before it
    (a naive reference); the divisor counts the model's tokens (dapo); the entropy and the logprob mismatch are the
    means over the model's tokens; garbage sampler logprobs at the tool's positions change nothing."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    T.disable_dropout(model)
    prompts = [[5, 17, 33], [44, 8]]
    parts = [([70, 71, 72], [200, 201, 202, 203], [73, 74]), ([90], [210, 211], [91, 92, 93, 94])]
    true = [reference_logprobs(model, p, m + t + x) for p, (m, t, x) in zip(prompts, parts, strict=True)]
    acts = [torch.tensor([1] * len(m) + [0] * len(t) + [1] * len(x)).bool() for m, t, x in parts]

    def samples(tool_logprob):
        return [
            sample_with_tool_tokens(
                p, m, t, x, lambda i, _, k=k: true[k][0][i].item() + (0.01 if acts[k][i] else tool_logprob)
            )
            for k, (p, (m, t, x)) in enumerate(zip(prompts, parts, strict=True))
        ]

    args = T.Args(group_size=2, loss_type=loss_type, max_grad_norm=1e9, activation_checkpointing=False)
    rewards = torch.tensor([1.0, 0.0])
    advantages = T.group_advantages(rewards, 2)
    runs = []
    for tool_logprob in (0.0, 100.0):
        batch = T.make_batch(samples(tool_logprob), rewards, advantages, args)
        assert batch.trained == [5, 5] and batch.n_comp == [9, 7]
        model.zero_grad()
        stats, bad = T.update_policy(
            model,
            None,
            torch.optim.SGD(model.parameters(), lr=0.0),
            batch,
            samples(tool_logprob),
            advantages,
            args,
            0,
            None,
            False,
        )
        assert bad == 0
        runs.append((stats, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (stats, grads), (stats2, grads2) = runs
    assert stats == stats2 and all(torch.equal(grads[n], grads2[n]) for n in grads)
    assert stats["tokens_fed"] == 10
    assert abs(stats["mismatch_sum"] / 10 - 0.01) < 1e-5  # the model's tokens alone: the tool's are 100 away
    entropy = torch.cat([h[a] for (_, h), a in zip(true, acts, strict=True)])
    assert abs(stats["entropy_sum"] / 10 - entropy.mean().item()) < 1e-4
    model.zero_grad()  # the reference: -A * logp of the model's tokens; grpo: each sequence's mean; dapo: all of them
    loss = 0
    for k, (p, (m, t, x)) in enumerate(zip(prompts, parts, strict=True)):
        logits = model(torch.tensor([p + m + t + x])).logits[0, len(p) - 1 : -1]
        logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(m + t + x)[:, None])[:, 0][acts[k]]
        loss = loss - advantages[k] * (logp.mean() / 2 if loss_type == "grpo" else logp.sum() / 10)
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-6, rtol=1e-4), n


# ---------------------------------------------------------------------------------------------------
# turns, token in and token out, on a tiny model that writes code blocks
CODE_TOKENS = [  # whole blocks as single tokens of the tiny tokenizer: a random policy writes one in ~17% of samples
    "```python\nprint(3 + 4)\n```\n",  # the right answer's number
    "```python\nprint(1 / 0)\n```\n",  # an error
    "```python\nwhile True:\n    pass\n```\n",  # a time-out
]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> str:
    """conftest's tiny model with CODE_TOKENS in its tokenizer (ordinary tokens, in the 3 ids its vocabulary left
    free): its code blocks are single tokens, its tool replies plain byte-level text."""
    from transformers import AutoTokenizer

    path = build_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-tool"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(CODE_TOKENS)
    assert len(tok) == 384  # the model's vocabulary, all used
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tool_server(tool_model, tmp_path_factory) -> str:
    proc, url = start_server(tool_model, str(tmp_path_factory.mktemp("tool_server") / "server.log"))
    yield url
    stop_server(proc)


def test_the_server_stops_at_a_fence_and_keeps_it(tool_server, tool_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model)
    code_id = tok.convert_tokens_to_ids(CODE_TOKENS[0])
    body = {"prompts": [[5, 17, 33]], "n": 64, "temperature": 1.0, "max_tokens": 24, "seed": 0, "stop": [T.TOOL_STOP]}
    body["include_stop_str_in_output"] = True
    completions = requests.post(tool_server + "/generate", json=body, timeout=120).json()["results"][0]["completions"]
    stopped = [c for c in completions if c["stop_reason"] == T.TOOL_STOP]
    assert stopped and all(c["text"].endswith(T.TOOL_STOP) and c["finish_reason"] == "stop" for c in stopped)
    assert any(c["token_ids"][-1] == code_id for c in stopped)
    assert all(c["stop_reason"] is None for c in completions if c["finish_reason"] == "length")


def test_a_multi_turn_samples_ids_and_logprobs(tool_server, tool_model):
    """Samples with tool calls: their ids are the model's ids of each turn, then the tool's reply tokenized on its
    own, in order (actions 0 exactly there); and the trainer's logprobs of the model's tokens, each turn conditioned
    on the tool's ids before it, equal the server's (the mismatch the run logs, computed the script's way)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model)
    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32)
    T.disable_dropout(model)
    args = T.Args(tool_timeout_s=3.0, max_tool_calls=2, tool_workers=8)  # (print and 1 / 0 end well within it, loaded)
    tool = T.start_tool(args, tok, T.sandbox_command())
    prompts = [T.prompt_ids(tok, "", q) for q in ("What is 2 + 5?", "What is 3 + 4?", "What is 6 + 1?")]
    results = T.generate(tool_server, prompts, 32, 1.0, 24, 16, [T.rollout_seed(0, i, 32) for i in range(3)], tool)
    samples = [T.Sample("q", "7", r["prompt_token_ids"], c, 0) for r in results for c in r["completions"]]
    called = [s for s in samples if s.completion["tool_calls"]]
    assert len(called) >= 5, [s.completion["tool_calls"] for s in samples]
    assert any(len(s.completion["turns"]) >= 3 and s.completion["turns"][2]["tokens"] for s in called)  # a later turn
    for s in called:
        c = s.completion
        assert len(c["token_ids"]) == len(c["logprobs"]) == len(c["actions"]) <= 24
        at = 0
        for turn in c["turns"]:
            span = c["token_ids"][at : at + turn["tokens"]]
            if turn["role"] == "tool":
                assert span == tok.encode(T.tool_reply(turn["text"]), add_special_tokens=False)[: turn["tokens"]]
                assert c["actions"][at : at + turn["tokens"]] == [0] * turn["tokens"]
                assert turn["code"] in CODE_TOKENS[0] + CODE_TOKENS[1] + CODE_TOKENS[2]
            else:
                assert c["actions"][at : at + turn["tokens"]] == [1] * turn["tokens"]
                assert tok.decode(span).startswith(turn["text"].rstrip("\ufffd"))
            at += turn["tokens"]
        assert at == len(c["token_ids"])
    statuses = {T.tool_status(t["text"]) for s in called for t in s.completion["turns"] if t["role"] == "tool"}
    assert statuses == {"ok", "error", "timeout"}, statuses
    args = T.Args(group_size=len(called), max_grad_norm=1e9, activation_checkpointing=False, micro_token_budget=64)
    rewards = (torch.arange(len(called)) % 2).float()  # no advantage exactly 0: every sample fed
    advantages = T.group_advantages(rewards, len(called))
    batch = T.make_batch(called, rewards, advantages, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    stats, _ = T.update_policy(model, None, optimizer, batch, called, advantages, args, tok.pad_token_id, None, False)
    mismatch = stats["mismatch_sum"] / stats["tokens_fed"]
    assert stats["tokens_fed"] == sum(sum(s.completion["actions"]) for s in called)
    assert mismatch <= 1e-4, mismatch
    print(f"{len(called)} of {len(samples)} samples called the tool; logprob mismatch {mismatch:.2e}")


# ---------------------------------------------------------------------------------------------------
# the script end to end
def script_cmd(url, *extra, model, dataset="gsm8k_toy") -> list:
    return [
        PY,
        os.path.join(ROOT, SCRIPT),
        "--model",
        model,
        "--dataset",
        os.path.join(FIXTURES, dataset),
        "--vllm-port",
        url.rsplit(":", 1)[1],
        "--checkpoint-dir",
        "ckpt",
        *GRADE_WORKERS,
        *extra,
    ]


def test_two_steps_with_the_tool_on_the_tiny_model(tool_server, tool_model, tmp_path):
    """2 steps: every tool metric logged (calls made, second turns, the shares of failed and timed-out calls that the
    rollout log's replies show), the trainer's logprobs equal the sampler's over turns, the rollout log holds every
    turn, the evaluation runs with the tool."""
    extra = ["--train-steps", "2", "--rollouts-per-update", "8", "--group-size", "8", "--learning-rate", "3e-3"]
    # 96 tokens: a call in a sample's first 53 gets a second turn whatever the load (a time-out's reply is 42 tokens,
    # and under load a 0.5 s limit can stop `print(3 + 4)` too); about a third of the samples have one
    extra += ["--max-completion-tokens", "96", "--system-prompt", "", "--keep-eval-overlap", "--eval-every", "2"]
    extra += ["--eval-limit", "8", "--tool-timeout-s", "0.5", "--max-tool-calls", "2"]
    r = run_ok(script_cmd(tool_server, *extra, model=tool_model), cwd=tmp_path, timeout=600)
    assert "python tool in bubblewrap" in r.stdout and "NOT HELD" not in r.stdout
    m = metrics_of(r.stdout)
    assert len(m) == 2
    for x in m:
        assert float(x["tool_calls"]) > 0 and float(x["turns"]) > 1, x
        assert float(x["logprob_mismatch"]) < 1e-5, x
        assert 0 < float(x["entropy"]) <= 5.951, x  # log(384)
        for key in ("tool_error_rate", "tool_timeout_rate", "tool_share_of_correct"):
            assert key in x
    assert "eval/tool_use_rate" in m[1]
    rollouts = read_jsonl(tmp_path / "gsm8k_train_rollouts.jsonl")
    assert len(rollouts) == 2 * 64
    timed_out = 0  # `while True` always runs out of time; whether `1 / 0` errors or times out depends on the load
    for step, x in enumerate(m, start=1):  # each call's status: its reply's last line, in the rollout log
        rows = [row for row in rollouts if row["step"] == step]
        last = [t["text"].rstrip("\n").rsplit("\n", 1)[-1] for row in rows for t in row["turns"] if t["role"] == "tool"]
        errors = sum(line.startswith("[exit status") for line in last)
        timeouts = sum(line.startswith("[stopped: over the time limit") for line in last)
        assert float(x["tool_error_rate"]) == pytest.approx(errors / len(last), abs=1e-3), x
        assert float(x["tool_timeout_rate"]) == pytest.approx(timeouts / len(last), abs=1e-3), x
        timed_out += timeouts
    assert timed_out > 0
    called = [row for row in rollouts if any(turn["role"] == "tool" for turn in row["turns"])]
    assert called and all("```output\n" in row["completion"] for row in called)
    row = called[0]
    assert row["completion"] == "".join(
        turn["text"] if turn["role"] == "model" else T.tool_reply(turn["text"]) for turn in row["turns"]
    )


# SmolLM2-135M-Instruct on the harder arithmetic tier, one step of 8 problems x 4 samples at the benchmark's
# temperature; whether it learns to use the tool is bench/python_tool.py's question, over seeds.
REAL_RECIPE = ["--limit", "8", "--rollouts-per-update", "8", "--group-size", "4", "--train-temperature", "0.6"]
REAL_RECIPE += ["--max-completion-tokens", "96", "--learning-rate", "2e-5", "--no-activation-checkpointing"]
REAL_RECIPE += ["--micro-token-budget", "4096", "--eval-every", "0", "--train-steps", "1"]


def test_the_real_model_calls_the_tool_and_trains_on_its_turns(real_model, tmp_path):
    """One step of SmolLM2 on the harder tier: it calls the tool (measured, seed 1: in 56% of its samples) and gets
    second turns, and the trainer's logprobs of its tokens equal the sampler's over those turns (float32): the
    multi-turn alignment holds on a real tokenizer and chat template, not only on the tiny model's."""
    proc, url = start_server(real_model, str(tmp_path / "server.log"), "--kv-cache-memory-bytes", str(256 << 20))
    try:
        cmd = script_cmd(url, *REAL_RECIPE, model=real_model, dataset="arithmetic_harder_gsm8k")
        r = run_ok(cmd, cwd=tmp_path, timeout=900)
    finally:
        stop_server(proc)
    (m,) = metrics_of(r.stdout)
    print({k: m[k] for k in ("reward", "tool_calls", "turns", "logprob_mismatch")})
    assert float(m["tool_calls"]) > 0 and float(m["turns"]) > 1, m
    assert float(m["logprob_mismatch"]) <= 1e-4, m
