
"""Shared fixtures: tiny Qwen2 models quantized by the real gptqmodel (seconds, not minutes).

The tiny model is chosen to hit the hard cases of real checkpoints: attention bias (q/k/v),
tied embeddings, a partial last group (down_proj K=320 with group 128), act-order.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The per-user kcache trust store and runtime copies: the test session's own (children inherit them).
_USER_STATE = Path(tempfile.mkdtemp(prefix="quantprep-tests-"))
os.environ.setdefault("QUANTPREP_TRUST_DIR", str(_USER_STATE / "trusted-kcache"))
os.environ.setdefault("QUANTPREP_KCACHE_DIR", str(_USER_STATE / "kcache"))
os.environ.setdefault("QUANTPREP_VERIFIED_DIR", str(_USER_STATE / "verified"))

REPO = Path(__file__).resolve().parent.parent
CALIB = (REPO / "quantprep" / "build" / "calibration.txt").read_text()

# `make test` runs two pytest workers (-n 2), and GroupScheduling gives each whole groups of tests:
# a file, or the files that use a session fixture costing minutes (SHARED_FIXTURE: each worker would
# build its own). That group goes first. test_smollm2 goes last: its GPTQModel run took 250 s beside
# another worker's compiling (80 s alone), and at the end it mostly runs alone. (pytest-xdist's
# loadgroup cannot group: it renames node ids, which pytest 9.2 no longer lets it do.)
SHARED_FIXTURE = "warmed_aot"
SHARING = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py") if SHARED_FIXTURE in p.read_text()}
FIRST, LAST = (SHARED_FIXTURE,), ("tests/test_smollm2.py",)


def group_of(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return SHARED_FIXTURE if path in SHARING else path


def pytest_collection_modifyitems(config, items):
    rank = {group: i for i, group in enumerate(FIRST)} | {group: len(FIRST) + 1 + i for i, group in enumerate(LAST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(FIRST)))  # stable: the rest in collection order


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent where it is not installed (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") not in ("load", "loadfile"):
        return None  # another mode asked for by name (each, worksteal, ...) stays xdist's

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # the groups in collection order: FIRST, the rest, LAST
    return GroupScheduling(config, log)


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A session fixture's directory, built once per run: pytest's workers share the parent of their
    base temp directories, and the first to take the lock builds it while the other waits."""
    base = tmp_path_factory.getbasetemp()
    if base.name.startswith("popen-gw"):  # a worker's (a child pytest inherits PYTEST_XDIST_WORKER, not this)
        base = base.parent
    out = base / f"shared-{name}"
    with open(base / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".built").is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            build(out)
            (out / ".built").touch()
    return out


def make_tiny_float_model(out: Path, seed: int = 0, model_type: str = "qwen2", **config) -> Path:
    """A 2-layer Qwen2 (or `model_type`, the sizes below unless `config` overrides them) with a
    word-level tokenizer built from the calibration texts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    words = sorted(set(CALIB.replace("\n", " ").split()))
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    sizes = dict(vocab_size=len(vocab), hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=1, pad_token_id=1)
    cfg = AutoConfig.for_model(model_type, **{**sizes, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def quantize_tiny(float_dir: Path, out: Path, **qc) -> Path:
    """Quantize in a subprocess: gptqmodel starts worker pools we do not want inside pytest."""
    quantize_tinies(float_dir, {out: qc})
    return out


TINY_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": False}


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def add_chat_tokenizer(gptq: Path, vocab_size: int) -> None:
    """A word-level tokenizer ("a".."z", "aa".., decoded joined by spaces) with a chat template, saved
    beside a random checkpoint (no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(97 + i % 26) * (1 + i // 26): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece(prefix="##")  # decodes joined by spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="a", pad_token="a", eos_token="zzzzzzzzzz",
                            chat_template=CHAT_TEMPLATE).save_pretrained(gptq)


@pytest.fixture
def random_gptq(tmp_path) -> Path:
    """A 1-layer Llama GPTQ checkpoint with random codes (no gptqmodel: milliseconds). K=160 with
    group 64 gives down_proj a partial last group."""
    from quantprep.build.synthetic import write_random_checkpoint

    return write_random_checkpoint(tmp_path / "gptq", TINY_LLAMA, bits=4, group_size=64, desc_act=True, sym=False)


def random_cpu_artifact(root: Path, config: dict, name: str = "art", act_dtype: str | None = None, fuse: bool = True,
                        **checkpoint) -> Path:
    """A cpu artifact at root/name, prepacked from a random GPTQ checkpoint of `config`
    (write_random_checkpoint's options in `checkpoint`; the checkpoint is shared per option set)."""
    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint

    gptq = root / ("gptq-" + "-".join(f"{k}={v}" for k, v in sorted(checkpoint.items())))
    if not gptq.exists():
        write_random_checkpoint(gptq, config, **checkpoint)
    prepack(gptq, "cpu", root / name, act_dtype, fuse=fuse)
    return root / name


@pytest.fixture
def random_artifact(random_gptq, tmp_path) -> Path:
    from quantprep.build.pipeline import prepack

    out = tmp_path / "artifact"
    prepack(random_gptq, "cpu", out)
    return out


@pytest.fixture(scope="session")
def tiny_float(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "tiny", lambda out: make_tiny_float_model(out / "float")) / "float"


@pytest.fixture(scope="session")
def tiny_gptq4(tiny_float, tmp_path_factory) -> Path:
    """4-bit, group 128, act-order, symmetric: the recipe default."""
    return built_once(tmp_path_factory, "q4", lambda out: quantize_tiny(tiny_float, out / "gptq", bits=4, group_size=128,
                                                                          desc_act=True, sym=True)) / "gptq"


@pytest.fixture(scope="session")
def tiny_gptq8(tiny_float, tmp_path_factory) -> Path:
    """8-bit, group 32, no act-order, asymmetric."""
    return built_once(tmp_path_factory, "q8", lambda out: quantize_tiny(tiny_float, out / "gptq", bits=8, group_size=32,
                                                                          desc_act=False, sym=False)) / "gptq"


def gptqmodel_run(gptq_dir: Path, input_ids: torch.Tensor, tmp: Path, new_tokens: int = 16) -> dict[str, torch.Tensor]:
    """Logits and a greedy continuation from the real GPTQModel, in a fresh process."""
    return gptqmodel_runs([(gptq_dir, input_ids, new_tokens)], tmp)[0]


QUANTIZE_MANY = (
    "import sys, json; from quantprep.build.quantize import quantize_gptq, builtin_calibration; "
    "from pathlib import Path\n"
    "for a in json.loads(sys.argv[1]):\n"
    "    quantize_gptq(Path(a['src']), Path(a['out']), a['bits'], a['group_size'], a['desc_act'], a['sym'], builtin_calibration(17), "
    "checkpoint_format=a.get('checkpoint_format', 'gptq'))"
)


def quantize_tinies(float_dir: Path, outs: dict[Path, dict]) -> None:
    """quantize_tiny for several recipes ({out dir: quantize options}) in ONE subprocess: gptqmodel's
    import and worker pools are paid once. quantize_gptq seeds every generator per call, so each
    checkpoint is the one quantize_tiny would write."""
    arg = json.dumps([{"src": str(float_dir), "out": str(out), **qc} for out, qc in outs.items()])
    proc = subprocess.run([sys.executable, "-c", QUANTIZE_MANY, arg], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


GPTQMODEL_RUNS = r"""
import json, sys, torch
from safetensors.torch import load_file, save_file
from gptqmodel import BACKEND, GPTQModel
for job in json.loads(sys.argv[1]):
    ids = load_file(job["io"])["input_ids"]
    # TORCH backend: GPTQModel's default CPU kernels crash on K % group_size != 0; it runs fp16/bf16 only.
    gm = GPTQModel.load(job["gptq_dir"], backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
    with torch.no_grad():
        if job["teacher_forced"]:  # logits over the prompt + GPTQModel's own greedy continuation
            greedy = gm.generate(input_ids=ids[:1], attention_mask=torch.ones_like(ids[:1]),
                                 max_new_tokens=job["new_tokens"], do_sample=False)[:, ids.shape[1]:]
            logits = gm.model(input_ids=torch.cat([ids[:1], greedy], 1)).logits.float()
        else:  # logits of the ids; no generate (the slow part: seconds a token on 2 cores) for 0 new tokens
            logits = gm.model(input_ids=ids).logits.float()
            greedy = gm.generate(input_ids=ids[:1], attention_mask=torch.ones_like(ids[:1]),
                                 max_new_tokens=job["new_tokens"], do_sample=False)[:, ids.shape[1]:] if job["new_tokens"] else ids[:1, :0]
    save_file({"logits": logits, "greedy": greedy.contiguous()}, job["io"])
    del gm
"""


def gptqmodel_runs(jobs: list[tuple[Path, torch.Tensor, int]], tmp: Path,
                   teacher_forced: bool = False) -> list[dict[str, torch.Tensor]]:
    """gptqmodel_run for several (gptq dir, input ids, new tokens) jobs in ONE fresh process (GPTQModel's
    import, seconds on 2 cores, is paid once; each checkpoint is loaded anew); 0 new tokens: logits only. With teacher_forced the
    logits are over the first row of ids followed by GPTQModel's own greedy continuation."""
    from safetensors.torch import load_file, save_file

    spec = []
    for i, (gptq_dir, input_ids, new_tokens) in enumerate(jobs):
        io = tmp / f"gptqmodel_io_{i}.safetensors"
        save_file({"input_ids": input_ids.contiguous()}, str(io))
        spec.append({"gptq_dir": str(gptq_dir), "io": str(io), "new_tokens": int(new_tokens), "teacher_forced": teacher_forced})
    # eager: GPTQModel's TORCH kernel torch.compiles its dequantize (about 10 s a model here), to the same logits bit for bit
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-c", GPTQMODEL_RUNS, json.dumps(spec)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [load_file(s["io"]) for s in spec]


def dense_reference_model(gptq_dir: Path, dtype: torch.dtype = torch.float32):
    """The same checkpoint with every quantized weight dequantized to a dense float Linear."""
    from quantprep.tools.eval import dequantized_model

    return dequantized_model(gptq_dir, dtype)


def prepacked_module(target_name: str, raw: dict, q, dtype: torch.dtype):
    """On-disk GPTQ tensors of one layer -> (PrepackLayer, the target's loaded module, its meta)."""
    from quantprep.build.prepack import prepare_layer
    from quantprep.build.source import _validate_layer
    from quantprep.targets import get_target

    target = get_target(target_name)
    layer = prepare_layer(_validate_layer("m", raw, q))
    tensors, meta = target.pack(layer, dtype)
    module = target.make_module(meta, dtype)
    module.load_state_dict(tensors, assign=True)
    return layer, module, meta


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


def top1(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.argmax(-1) == ref.argmax(-1)).float().mean().item()


@pytest.fixture(scope="session")
def warmed_aot(tmp_path_factory):
    """A 2-layer random cpu artifact warmed with compile and compiled MLP packages (AOTInductor on
    the CPU), by this user: its kcache is in the session's trust store. Shared: use copy_of to edit."""
    from test_warm import _build

    from quantprep.runtime.warm import warm

    art = _build(tmp_path_factory.mktemp("aot"))
    return art, warm(art, progress=False)


@pytest.fixture
def copy_of(tmp_path):
    """A writable copy of an artifact (module-scoped fixtures' artifacts are shared)."""
    def make(art):
        dest = tmp_path / "copy"
        shutil.copytree(art, dest)
        return dest
    return make


def fresh_process(code: str, *args, env: dict | None = None, timeout: float = 900) -> tuple[dict, str]:
    """Run `code` in a new Python process (nothing cached from this one): the JSON of its last stdout
    line, and its stderr. A failing child fails the test, showing its stderr."""
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_with_client(art, timeout: float = 120):
    """`quantprep serve ART` in a child (stdout and stderr piped together), started on a free port,
    and an openai client once its /v1/models answers (bounded): (process, client)."""
    import time

    import openai
    from openai import OpenAI

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "quantprep", "serve", str(art), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.models.list()
            return proc, client
        except openai.APIConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the server did not start: {proc.stdout.read()[-2000:]}")
            time.sleep(0.2)


def serve(argv: list[str], probe_url: str, what: str, timeout: float = 60, **popen):
    """Start a server process and wait (bounded) until `probe_url` answers anything; returns a stop()."""
    import time
    import urllib.error
    import urllib.request

    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **popen)
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(probe_url, timeout=1)
            break
        except urllib.error.HTTPError:  # it answers (401 with auth, 404)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{what} did not start: {proc.stderr.read().decode()[-500:]}")
            time.sleep(0.1)

    def stop():
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()

    return stop


def edit_manifest(art: Path, edit) -> dict:
    """Change an artifact's manifest as anyone can (edit(manifest) in place), with a fresh self-digest."""
    from quantprep.format.artifact import MANIFEST, manifest_digest

    m = json.loads((art / MANIFEST).read_text())
    edit(m)
    m["manifest_sha256"] = manifest_digest(m)
    (art / MANIFEST).write_text(json.dumps(m))
    return m


def relist(art: Path, *names: str) -> dict:
    """Record the files `names` as they are now in the artifact's manifest (sha256 and size)."""
    from quantprep.format.artifact import sha256_file

    def edit(m):
        for name in names:
            m["files"][name] = {"sha256": sha256_file(art / name), "size": (art / name).stat().st_size}
    return edit_manifest(art, edit)


def one_line_error(capsys) -> str:
    """The CLI's stderr after exit 2: exactly one line, no traceback."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def leftovers(out: Path) -> list[str]:
    """What writers of `out` left beside it (staging siblings), by name; the `.lock` file is meant to stay."""
    return sorted(p.name for p in out.parent.glob(f".{out.name}.*") if not p.name.endswith(".lock"))


PAUSED_CLI = """import sys, time
from quantprep._io import staging

def pause(stage, at=sys.argv[1]):
    if stage == at:
        print(f"quantprep: paused at {stage}", file=sys.stderr, flush=True)
        time.sleep(3600)

staging.stage_hook = pause
from quantprep.cli import main
sys.exit(main(sys.argv[2:]))
"""


def cli_paused_at(stage: str, *args: str) -> list[str]:
    """argv of the quantprep CLI that sleeps when it reaches `stage` (staging.stage_reached), so a
    kill test's SIGKILL lands there. The seam is set only in this child process."""
    return [sys.executable, "-c", PAUSED_CLI, stage, *args]


# --- publishing: artifacts to publish, the pull cache, keys, a real OCI registry ---


@pytest.fixture
def built(random_gptq, tmp_path):
    from quantprep.build.pipeline import prepack

    for target in ("cpu", "xpu"):
        prepack(random_gptq, target, tmp_path / "art" / target)
    return tmp_path / "art"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTPREP_PULL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def files_left_in(root):
    """What a refused pull left in the cache: nothing but empty dirs and the (empty) publish lock."""
    return [p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock")] if root.exists() else []


def keypair(path):
    """An EC P-256 key pair in PEM under `path`: (private key, public key)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path.mkdir(parents=True, exist_ok=True)
    (path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    (path / "pub.pem").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                 serialization.PublicFormat.SubjectPublicKeyInfo))
    return path / "key.pem", path / "pub.pem"


REGISTRY_BIN = "/usr/bin/docker-registry"


@pytest.fixture
def registry(tmp_path):
    yield from start_registry(tmp_path)


def start_registry(tmp_path, auth: str = ""):
    """A real OCI registry (CNCF distribution, from Debian) on a loopback port: yields (host:port,
    its storage directory), then stops it. `auth`: extra config, {port} filled in."""
    if not os.path.exists(REGISTRY_BIN):
        if os.environ.get("CI") == "true":
            pytest.fail(f"{REGISTRY_BIN} missing: `make setup` installs Debian's docker-registry when run as root")
        pytest.skip(f"{REGISTRY_BIN} missing (apt-get install docker-registry)")
    port = free_port()
    storage = tmp_path / "registry-storage"
    config = tmp_path / "registry.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {storage}\n"
                      f"  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n{auth.format(port=port)}")
    stop = serve([REGISTRY_BIN, "serve", str(config)], f"http://127.0.0.1:{port}/v2/", "the registry", timeout=20)
    try:
        yield f"127.0.0.1:{port}", storage
    finally:
        stop()
