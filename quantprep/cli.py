"""`quantprep` command line. User errors: one line on stderr, exit 2, no traceback."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from quantprep.errors import ArtifactError, QuantprepError
from quantprep.format.expert_names import count_experts, expert_linear

TRUST_HELP = ("run the artifact's kcache/ (compiled code) although it was not warmed here by you; "
              "only for artifacts from a source you trust (also QUANTPREP_TRUST_KCACHE=1)")


RECIPES_HELP = "also look for recipes (NAME.toml) in DIR, before the built-in ones (repeatable; also QUANTPREP_RECIPES)"


def _print_json_or(args, data, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def cmd_build(args) -> int:
    from quantprep._io.staging import check_replaceable
    from quantprep.build.pipeline import DEFAULT_OUT, build_artifacts, resolve_source
    from quantprep.build.recipes import find_recipe
    from quantprep.format.artifact import is_artifact
    from quantprep.targets import get_target

    shard_bytes = _shard_bytes(args)  # bad options fail before any work
    recipe = find_recipe(args.recipe, args.recipes)
    overrides = {k: v for k, v in (("calibration", args.calibration), ("samples", args.samples), ("seq_len", args.seq_len))
                 if v is not None}
    if overrides:
        import dataclasses

        if "calibration" in overrides and overrides["calibration"].endswith((".txt", ".jsonl")):
            overrides["calibration"] = str(Path(overrides["calibration"]).absolute())
        recipe = dataclasses.replace(recipe, **overrides)
    targets = args.target or recipe.targets
    out_root = Path(args.out) if args.out else DEFAULT_OUT / recipe.name
    user_source = Path(args.source) if args.source and Path(args.source).exists() else None
    for t in targets:
        get_target(t)  # unknown names and output dirs that must not be replaced fail before quantizing
        check_replaceable(out_root / t, is_artifact, "quantprep artifact", args.force, user_source)
    gptq_dir, identity = resolve_source(recipe, args.source, args.quantize_device, args.verbose, progress=not args.json)
    if on := identity.get("quantized_on"):
        print(f"GPTQ checkpoint {gptq_dir} (quantized by gptqmodel on {on})", file=sys.stderr)
    serving = {"shapes": recipe.warm_shapes, "compile": recipe.warm_compile, "aot": recipe.warm_aot}
    results = build_artifacts(gptq_dir, identity, targets, lambda t: out_root / t, recipe.act_dtype,
                              progress=not args.json, serving=serving, warm_here=args.warm and recipe.warm_enabled,
                              fuse=args.fuse, force=args.force, shard_bytes=shard_bytes, lm_head=args.lm_head or recipe.lm_head)
    if args.check:
        for r in results:
            if get_target(r["target"]).runtime_problem() is None:
                r["check"] = _fresh_process_generate(Path(r["path"]), recipe.prompt, recipe.max_new_tokens, quiet=args.json)
    _print_json_or(args, results, "\n".join(f"wrote {r['path']} ({r['bytes'] / 2**20:.1f} MiB, {r['layers']} layers, "
                                            f"prepack {r['prepack_s']:.2f} s{_warm_text(r.get('warm'))})" for r in results))
    return 0


def _int_list(option: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise QuantprepError(f"{option} {text!r}: expected comma-separated integers such as 1,16,128,512") from None


def _warm_text(w: dict | None) -> str:
    return f", warmed {w['shapes']} in {w['s']:.1f} s: kcache {w['files']} files {w['bytes'] / 2**20:.1f} MiB" if w else ""


def cmd_warm(args) -> int:
    from quantprep.runtime.warm import warm
    from quantprep.tools.serving import PREFILL_BUCKETS

    shapes = (PREFILL_BUCKETS if args.shapes == "buckets" else _int_list("--shapes", args.shapes)) if args.shapes else None
    r = warm(Path(args.dir), device=args.device, shapes=shapes, compile=args.compile, aot=args.aot, progress=not args.json,
             int8_activations=args.int8_activations)
    what = r.get("what") or f"prefill {r['shapes']}, {r['compiled_regions']} compiled regions, {len(r['aot'])} compiled MLP packages"
    _print_json_or(args, r, f"warmed {r['path']} on {r['key']['device']}: {what}, {r['s']:.1f} s; kcache {r['files']} files, "
                            f"{r['bytes'] / 2**20:.1f} MiB")
    return 0


def cmd_exec(args) -> int:
    import os

    from quantprep.runtime.kcache import exec_env

    cmd = args.cmd
    if "--" in cmd:  # options between DIR and `--` (argparse hands them over with the command)
        options, cmd = cmd[:cmd.index("--")], cmd[cmd.index("--") + 1:]
        for option in options:
            if option != "--trust-kcache":
                raise QuantprepError(f"exec: unknown option {option!r}; usage: quantprep exec [--trust-kcache] DIR -- CMD [ARGS...]")
            args.trust_kcache = True
    if not cmd:
        raise QuantprepError("nothing to run: quantprep exec DIR -- CMD [ARGS...]")
    env = exec_env(args.dir, trust=args.trust_kcache)
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as e:
        raise QuantprepError(f"{cmd[0]}: cannot run ({e.strerror})") from None


def _fresh_process_generate(path: Path, prompt: str, max_new_tokens: int, quiet: bool) -> dict:
    """Load the artifact back in a new Python process (nothing cached in this one) and generate."""
    cmd = [sys.executable, "-m", "quantprep", "generate", str(path), "--prompt", prompt,
           "--max-new-tokens", str(max_new_tokens), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise QuantprepError(f"{path}: the fresh-process load check failed: {proc.stderr.strip().splitlines()[-1:]}")
    result = json.loads(proc.stdout)
    if not quiet:
        print(f"{path}: fresh process loaded in {result['load_s']:.2f} s, first token after {result['first_token_s']:.2f} s")
        print(f"  prompt: {prompt}\n  completion: {result['completion']!r}")
    return result


LM_HEAD_HELP = ("int8: round the float lm_head to int8 per output channel; int4: to int4 in groups of 128 (quantprep's "
                "rounding, not GPTQ's: it changes the model; decode reads 2x or 4x fewer bytes for it; docs/usage.md)")
SHARD_HELP = ("safetensors shard size (default 512, artifact.SHARD_BYTES): the build holds one layer and one shard per "
              "target in memory (the one filling, and what is not yet written of the last), whatever the model's size")


def _shard_bytes(args) -> int:
    if args.shard_size is None:
        from quantprep.format.artifact import SHARD_BYTES

        return SHARD_BYTES
    if not 1 <= args.shard_size <= 1 << 20:
        raise QuantprepError(f"--shard-size {args.shard_size}: pass MiB between 1 and {1 << 20}")
    return args.shard_size << 20


def cmd_prepack(args) -> int:
    from quantprep.build.pipeline import prepack
    from quantprep.build.source import is_gptq_dir

    src = Path(args.gptq_dir)
    if not src.is_dir():
        raise QuantprepError(f"{src}: no such directory; pass a GPTQ checkpoint directory")
    if not is_gptq_dir(src):
        raise QuantprepError(f"{src}: not a GPTQ checkpoint (no quantize_config.json or quantization_config); use `quantprep build RECIPE --source {src}` to quantize a float model")
    r = prepack(src, args.target, args.out, args.act_dtype, fuse=args.fuse, force=args.force, progress=not args.json, lm_head=args.lm_head,
                shard_bytes=_shard_bytes(args))
    _print_json_or(args, r, f"wrote {r['path']} ({r['bytes'] / 2**20:.1f} MiB, {r['layers']} layers, prepack {r['prepack_s']:.2f} s)")
    return 0


def cmd_inspect(args) -> int:
    from quantprep.format.artifact import read_manifest

    m = read_manifest(Path(args.dir))
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    t, q = m["target"], m["quant"]
    size = sum(f["size"] for f in m["files"].values())
    lines = [
        f"artifact   {args.dir}",
        f"source     {m['source'].get('id') or 'a local GPTQ checkpoint'} (sha256 {m['source']['sha256'][:16]}...)",
        f"quant      {q['bits']}-bit, group {q['group_size']}, desc_act={q['desc_act']}, sym={q['sym']}, from {q['checkpoint_format']}",
        f"target     {t['name']} ({', '.join(t['kernels'].values())}), layout v{t['layout_version']}, act {t['act_dtype']}",
        f"compat     {', '.join(f'{k}={v}' for k, v in m['compat'].items())}",
        f"modules    {len(m['modules'])} quantized linears, act-order on {sum(x['act_order'] for x in m['modules'].values())}",
    ]
    if (experts := count_experts(m["modules"]))["experts"]:
        lines.append(f"experts    {_experts_line(experts)}")
    lines.append(f"files      {len(m['files'])}, {size / 2**20:.1f} MiB; built {m['created']} by quantprep {m['quantprep_version']}")
    for e in m.get("eval", {}).values():
        lines.append(f"eval       {_eval_line(e)}")
    # the manifest is the artifact's: on a terminal its control characters print escaped (terminal_safe)
    print(_for_stdout("\n".join(lines)))
    return 0


def _experts_line(experts: dict) -> str:
    return f"{experts['experts']} in {experts['moe_layers']} MoE layers, {experts['linears']} of the quantized linears"


def _eval_line(e: dict) -> str:
    return (f"ppl {e['ppl']:.4f} vs {e['reference']['kind']} {e['reference']['ppl']:.4f} (ratio {e['ppl_ratio']:.4f}), "
            f"KLD mean {e['kld']['mean']:.4f} p99 {e['kld']['p99']:.4f}, top-1 {100 * e['top1_agree']:.2f}%, "
            f"{e['tokens']} tokens of {e['text']['name']}, ctx {e['ctx']}"
            + (f", {e['experts']['routed']} of {e['experts']['experts']} experts routed to" if "experts" in e else ""))


def cmd_eval(args) -> int:
    from quantprep.tools.eval import evaluate

    r = evaluate(args.dir, reference=args.reference, text_file=args.text, dataset=args.dataset, ctx=args.ctx,
                 max_tokens=args.max_tokens, device=args.device, dtype=args.dtype, store=args.store, progress=not args.json)
    if args.plot:
        from quantprep.tools.eval import plot

        plot(r, Path(args.dir), args.plot)
    r.pop("kld_values")
    note = " (a dequantized reference: this measures the kernels' error only)" if r["reference"]["kind"] == "dequantized" else ""
    halves = " / ".join(f"{x:.4f}" for x in r["halves_ppl"])
    _print_json_or(args, r, f"{args.dir} ({r['target']} on {r['device']}): {_eval_line(r)}{note}\n"
                            f"  the two halves of the text: ppl {halves}")
    return 0


def cmd_verify(args) -> int:
    from quantprep.tools.verify import verify_artifact

    report = verify_artifact(Path(args.dir), strict=False)
    kc = f" + {report['kcache_files']} kcache files" if "kcache_files" in report else ""
    lines = [f"{args.dir}: {report['files']} files{kc}, sha256 ok"]
    how = f" (CPU path of the {report['target']} kernels; no {report['target']} device here)" if report.get("emulated") else ""
    # experts: one line for all of them (thousands in a real MoE), and each failed one
    lines += [f"  {r['layer']} x{r['rows']}: rel err {r['rel_err']:.2e} (tol {r['tol']:.0e}) {'ok' if r['ok'] else 'FAILED'}{how}"
              for r in report["probes"] if not (r["ok"] and expert_linear(r["layer"]))]
    if experts := report.get("experts"):
        rows = [r for r in report["probes"] if expert_linear(r["layer"])]
        lines.append(f"  experts: {experts['probed']} of {_experts_line(experts)}, probed: max rel err "
                     f"{max((r['rel_err'] for r in rows), default=0):.2e} over {len(rows)} runs{how}")
    if report["skipped"]:
        lines.append(f"  {report['skipped']}")
    _print_json_or(args, report, _for_stdout("\n".join(lines)))  # layer names are the manifest's
    if report["numeric"] == "failed":
        raise QuantprepError(report["error"])
    if report["numeric"] == "skipped" and not args.allow_skip:
        raise QuantprepError(f"{args.dir}: {report['skipped']}; pass --allow-skip to accept an artifact whose numbers cannot be checked here")
    return 0


def cmd_list(args) -> int:
    from quantprep.build.recipes import list_recipes, parse_recipe

    rows = [parse_recipe(p) for p in list_recipes(args.recipes)]
    _print_json_or(args, [{"name": r.name, "description": r.description, "targets": r.targets} for r in rows],
                   "\n".join(f"{r.name:16s} {r.description} (targets: {', '.join(r.targets)})" for r in rows))
    return 0


def cmd_selftest(args) -> int:
    from quantprep.targets import devices_here
    from quantprep.tools.selftest import run_selftest, shareable, summary_lines

    report = run_selftest(args.device or devices_here()[0])
    if args.report:
        try:
            Path(args.report).write_text(json.dumps(shareable(report), indent=2) + "\n")
        except OSError as e:
            raise QuantprepError(f"{args.report}: cannot write the report ({e.strerror}); pass another --report path") from None
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(summary_lines(report)))
        if args.report:
            print(f"report for a hardware issue: {args.report} (no paths, user or host names)")
    return 0 if report["ok"] else 1


def cmd_publish(args) -> int:
    from quantprep.distribution.publish import publish

    plan = publish(args.dirs, args.to, dry_run=args.dry_run, sign_key=args.sign_key, plain_http=args.plain_http, tag=args.tag,
                   force=args.force)
    lines = [f"{'would publish' if args.dry_run else 'published'} {len(plan['variants'])} variant(s) to {plan['to']}"]
    lines += [f"  {v['name']}: {v['from']} ({v['files']} files, {v['bytes'] / 2**20:.1f} MiB)" for v in plan["variants"]]
    lines += [f"release: {plan['release']}"] if "release" in plan else []
    _print_json_or(args, plan, "\n".join(lines))
    return 0


def cmd_sign(args) -> int:
    from quantprep.distribution.signing import sign
    from quantprep.format.artifact import read_checked

    read_checked(Path(args.dir), full_hash=True)  # sign only what verifies
    identity = None
    if args.for_ref:
        from quantprep.distribution.publish import reference_identity, signed_identity

        asked = reference_identity(args.for_ref)
        identity = signed_identity(asked)
    print(f"signed {args.dir}: {sign(args.dir, args.key, identity)}")
    return 0


def cmd_pull(args) -> int:
    from quantprep.distribution.publish import pull

    path = pull(args.ref, out=args.out, target=args.target, verify_key=args.verify_key, plain_http=args.plain_http, force=args.force)
    _print_json_or(args, {"ref": args.ref, "path": str(path)}, f"pulled {args.ref} -> {path} (every file's sha256 checked)")
    return 0


def cmd_generate(args) -> int:
    t0 = time.perf_counter()
    if args.native:
        return _generate_native(args, t0)
    import torch

    from quantprep import load

    model = load(args.dir, trust_kcache=args.trust_kcache)
    t1 = time.perf_counter()
    if hasattr(model, "pipeline"):  # an openvino artifact: openvino.genai generates (runtime/openvino.py)
        first = model.generate(args.prompt, max_new_tokens=1)
        t2 = time.perf_counter()
        completion = model.generate(args.prompt, max_new_tokens=args.max_new_tokens) if args.max_new_tokens > 1 else first
        return _print_generated(args, {"load_s": t1 - t0, "first_token_s": t2 - t0, "completion": completion})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.quantprep_path, trust_remote_code=False)  # the directory load checked
    if tok.chat_template:
        with _chat_template_failures(model.quantprep_path):
            enc = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
    else:
        enc = tok(args.prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=1, do_sample=False)
        t2 = time.perf_counter()
        if args.max_new_tokens > 1:
            out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)
    completion = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return _print_generated(args, {"load_s": t1 - t0, "first_token_s": t2 - t0, "completion": completion})


# What a terminal acts on rather than shows (titles, clearing, colours, cursor moves): the C0 controls but
# newline and tab, DEL, and the C1 controls (U+0080-U+009F; U+009B alone is CSI to many terminals)
TERMINAL_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """`text` with each terminal control character written as Python writes it in a string (ESC as \\x1b)."""
    return TERMINAL_CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _for_stdout(text: str) -> str:
    """Human-readable output quoting an artifact (inspect, verify): terminal_safe on a terminal, as it is
    piped or redirected. --json needs nothing: json.dumps escapes every control character."""
    return terminal_safe(text) if sys.stdout.isatty() else text


def _print_error(text: str) -> None:
    """main's one-line error on stderr. Errors quote what they refuse (a manifest's field names, an IR's layer
    types, a server's answer): on a terminal their control characters print escaped."""
    print(f"quantprep: error: {terminal_safe(text) if sys.stderr.isatty() else text}", file=sys.stderr)


def _print_generated(args, result: dict) -> int:
    """generate's timings and completion. The completion is the model's: its vocabulary can hold escape
    sequences, so on a terminal its control characters print escaped; piped or redirected, it prints as
    generated. --json needs nothing: json.dumps escapes every control character."""
    completion = terminal_safe(result["completion"]) if sys.stdout.isatty() else result["completion"]
    _print_json_or(args, result, f"load {result['load_s']:.2f} s, first token {result['first_token_s']:.2f} s\n{completion}")
    return 0


@contextmanager
def _chat_template_failures(directory: Path):
    """transformers rendering an artifact's chat template: a failure of the template's own making is one
    line naming its file, as generate --native says it (runtime/tokenizer.py). Anything else propagates."""
    from quantprep.runtime.tokenizer import FIX, said

    try:
        yield
    except Exception as e:
        if not _made_by_template(e):
            raise
        # AutoTokenizer reads chat_template.jinja where there is one, else tokenizer_config.json's
        where = directory / "chat_template.jinja"
        where = where if where.is_file() else directory / "tokenizer_config.json"
        raise ArtifactError(f"{where}: the chat template failed ({type(e).__name__}: {said(e)}); {FIX}") from None


def _made_by_template(e: Exception) -> bool:
    """Whether an exception out of apply_chat_template is the template's: jinja2's own (a syntax error,
    the sandbox's refusal, raise_exception's TemplateError), a RecursionError (jinja2 parses nesting
    recursively), Python's compiler refusing the code jinja2 made of it (more than 20 nested blocks), or
    anything raised while that code ran (`{{ 1 / 0 }}`); jinja2 names that code "<template>"."""
    import jinja2

    if isinstance(e, (jinja2.TemplateError, RecursionError)):
        return True
    if isinstance(e, SyntaxError):
        return e.filename == "<template>"
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False


def _generate_native(args, t0: float) -> int:
    """generate without torch or transformers: runtime/engine.py and runtime/tokenizer.py."""
    if "://" in args.dir or not Path(args.dir, "manifest.json").exists():
        raise QuantprepError(f"{args.dir}: --native runs an artifact directory (with a manifest.json); for a published reference, "
                             f"`quantprep pull {args.dir} --target cpu --out DIR` first")
    from quantprep.runtime import engine
    from quantprep.runtime.tokenizer import ArtifactTokenizer

    model = engine.load(args.dir)
    t1 = time.perf_counter()
    tok = ArtifactTokenizer(model.path, model.files)  # the directory load checked, the files its manifest lists
    ids, context = tok.prompt_ids(args.prompt), model.config.context
    if not ids or args.max_new_tokens < 1 or len(ids) + args.max_new_tokens > context:
        raise QuantprepError(f"{len(ids)} prompt tokens and --max-new-tokens {args.max_new_tokens}: give at least one of each, "
                             f"{context} at most together (the model's max_position_embeddings)")
    if max(ids) >= model.config.vocab:
        raise ArtifactError(f"{model.path / 'tokenizer.json'}: the prompt encodes to token id {max(ids)}, outside the model's "
                            f"{model.config.vocab}; rebuild the artifact from a source whose tokenizer matches its model")
    tokens = [tok.pick(model.forward(ids), ids)]
    t2 = time.perf_counter()
    while len(tokens) < args.max_new_tokens and tokens[-1] not in tok.eos:  # greedy, as generate(do_sample=False)
        tokens.append(tok.pick(model.forward(tokens[-1:]), ids + tokens))
    return _print_generated(args, {"load_s": t1 - t0, "first_token_s": t2 - t0, "completion": tok.decode(tokens)})


def cmd_serve(args) -> int:
    from quantprep.tools.serving import serve

    def ready(info: dict) -> None:
        print(f"serving {info['model']} at {info['url']} (kcache {info['kcache']}, warm-up {info['warmup']}); "
              "Ctrl-C or SIGTERM stops", flush=True)

    serve(args.src, host=args.host, port=args.port, warmup=args.warmup, trust_kcache=args.trust_kcache,
          verify_key=args.verify_key, device=args.device, ready=ready)
    return 0


def prefer_huge_pages() -> None:
    """PyTorch's CPU allocator on transparent huge pages (THP_MEM_ALLOC_ENABLE, read at the
    process's first tensor allocation, so before any): prepack's and the dequantize paths' large
    temporaries otherwise take a page fault per 4 KiB on first touch; prepack at the 7B-32B shapes
    is faster with it (benchmarks/experiments/results/thp-prepack-cpu-avx512.json). The environment wins."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def main(argv: list[str] | None = None) -> int:
    prefer_huge_pages()
    # torchao (imported by transformers when installed) logs deprecation noise at import; keep
    # stderr for our one-line errors. A filter, since torch's logging setup resets logger levels.
    logging.getLogger("torch.utils._pytree").addFilter(lambda record: record.levelno >= logging.ERROR)
    p = argparse.ArgumentParser(prog="quantprep", description="Prepare GPTQ models offline so serving loads them in seconds.")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="source -> prepack -> artifact for a recipe")
    b.add_argument("recipe", help="recipe name (see `quantprep list`) or path to a .toml file")
    b.add_argument("--recipes", action="append", metavar="DIR", help=RECIPES_HELP)
    b.add_argument("--source", help="GPTQ checkpoint dir, float model dir, or hub id (overrides the recipe's source)")
    b.add_argument("--target", action="append", help="target (repeatable); default: the recipe's targets")
    b.add_argument("--out", help="output root; artifacts go to OUT/<target> (default artifacts/<recipe>)")
    b.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="load each artifact runnable here in a fresh process and generate (default: on)")
    b.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                   help="warm each artifact whose device is present, openvino excepted (see `warm`; default: on)")
    b.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=True,
                   help="prepack q/k/v and gate/up as one matmul where their act-order matches (default: on)")
    b.add_argument("--lm-head", metavar="{float,int8,int4}", help=LM_HEAD_HELP + " (default: the recipe's build.lm_head, else float)")
    b.add_argument("--calibration", metavar="SPEC", help="builtin, a .txt/.jsonl file or a dataset id from the local datasets "
                                                         "cache (default: the recipe's)")
    b.add_argument("--samples", type=int, help="calibration samples (default: the recipe's)")
    b.add_argument("--seq-len", type=int, help="cut the calibration text into windows of this many tokens (default: the recipe's)")
    b.add_argument("--quantize-device", default="auto", help="where gptqmodel quantizes a float source: a torch device a target "
                                                              "runs on (auto: an accelerator, else cpu); recorded in the manifest")
    b.add_argument("--force", action="store_true", help="replace an output dir that is not an artifact (never the source)")
    b.add_argument("--shard-size", type=int, metavar="MIB", default=None, help=SHARD_HELP)
    b.add_argument("--verbose", action="store_true", help="show gptqmodel's own output (default: in a log file beside the "
                                                          "quantized checkpoint in the build cache, its end shown on failure)")
    b.add_argument("--json", action="store_true", help="print a JSON summary")
    b.set_defaults(func=cmd_build)

    pp = sub.add_parser("prepack", help="an existing GPTQ checkpoint dir -> artifact")
    pp.add_argument("gptq_dir")
    pp.add_argument("--target", required=True)
    pp.add_argument("--out", required=True)
    pp.add_argument("--act-dtype", choices=["bfloat16", "float16", "float32"], help="default: the target's")
    pp.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=True,
                    help="prepack q/k/v and gate/up as one matmul where their act-order matches (default: on)")
    pp.add_argument("--lm-head", metavar="{float,int8,int4}", default="float", help=LM_HEAD_HELP + " (default: float)")
    pp.add_argument("--force", action="store_true", help="replace an --out dir that is not an artifact (never the source)")
    pp.add_argument("--shard-size", type=int, metavar="MIB", default=None, help=SHARD_HELP)
    pp.add_argument("--json", action="store_true")
    pp.set_defaults(func=cmd_prepack)

    for name, func, helptext in (("inspect", cmd_inspect, "summarize an artifact's manifest"),
                                 ("verify", cmd_verify, "check file hashes and numeric probes at decode and prefill sizes")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("dir")
        s.add_argument("--json", action="store_true")
        if name == "verify":
            s.add_argument("--allow-skip", action="store_true",
                           help="exit 0 when the numeric check cannot run here (an artifact for another CPU ISA or torch)")
        s.set_defaults(func=func)

    ev = sub.add_parser("eval", help="perplexity, KL divergence and top-1 agreement against the float (or dequantized) model")
    ev.add_argument("dir")
    ev.add_argument("--reference", metavar="DIR", help="a float model or GPTQ checkpoint dir (default: the build's float model "
                                                      "when its cache holds it, else the GPTQ checkpoint)")
    src = ev.add_mutually_exclusive_group()
    src.add_argument("--text", metavar="FILE", help="a UTF-8 text file (default: quantprep's held-out text)")
    src.add_argument("--dataset", metavar="NAME", help="wikitext2, from the datasets library's cache")
    ev.add_argument("--ctx", type=int, default=512, help="tokens per window (default 512)")
    ev.add_argument("--max-tokens", type=int, help="score at most this many tokens (whole windows)")
    ev.add_argument("--device", help="default: the target's device (xpu: its CPU emulator when no card; openvino: CPU)")
    ev.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                    help="activation dtype (default: the artifact's; openvino: float32 runs the plugin exactly, else its defaults)")
    ev.add_argument("--store", action=argparse.BooleanOptionalAction, default=True,
                    help="record the result in the artifact's manifest (default: on)")
    ev.add_argument("--plot", metavar="FILE.png", help="draw perplexity per target and the KL divergence distribution")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval)

    w = sub.add_parser("warm", help="run the serving shapes and ship the kernel caches in DIR/kcache/")
    w.add_argument("dir")
    w.add_argument("--device", help="default: the artifact's target device")
    w.add_argument("--shapes", help="comma-separated prefill lengths, or `buckets` for quantprep.tools.serving.PREFILL_BUCKETS "
                                    "(default: the manifest's, else 1,16,128,512)")
    w.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile and ship its cache (default: the recipe's choice recorded in the manifest)")
    w.add_argument("--aot", action=argparse.BooleanOptionalAction, default=None,
                   help="with --compile, also ship compiled packages of the MLPs (AOTInductor, else Inductor artifacts), "
                        "which load without dynamo (default: on)")
    w.add_argument("--int8-activations", action="store_true",
                   help="let the kernel plan pick paths that round the activations to int8 where faster (cpu: int4_a8, "
                        "int8_a8; AVX512-VNNI, or AVX2 and FMA); they change the model's numbers slightly (docs/usage.md)")
    w.add_argument("--json", action="store_true")
    w.set_defaults(func=cmd_warm)

    x = sub.add_parser("exec", help="run CMD with the artifact's kernel caches active: quantprep exec DIR -- CMD...")
    x.add_argument("dir")
    x.add_argument("--trust-kcache", action="store_true", help=TRUST_HELP)
    x.add_argument("cmd", nargs=argparse.REMAINDER)
    x.set_defaults(func=cmd_exec)

    lp = sub.add_parser("list", help="list recipes")
    lp.add_argument("--recipes", action="append", metavar="DIR", help=RECIPES_HELP)
    lp.add_argument("--json", action="store_true")
    lp.set_defaults(func=cmd_list)

    st = sub.add_parser("selftest", help="check and time this machine's kernels against the dense reference")
    st.add_argument("--device", help="a torch device a target runs on (cpu, xpu, cuda; default: an accelerator, else cpu), "
                                     "or CPU and GPU (upper case): OpenVINO's devices (the openvino target)")
    st.add_argument("--report", metavar="FILE", help="also write the report as one file to share (JSON with a readable summary, "
                    "no paths, user or host names): attach it to a hardware report issue")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_selftest)

    pb = sub.add_parser("publish", help="publish artifacts as the variants of one reference "
                                        "(a directory, file:// URL, oci://HOST/REPO:TAG or hf://ORG/REPO[@BRANCH])")
    pb.add_argument("dirs", nargs="+", metavar="DIR")
    pb.add_argument("--to", required=True, metavar="REF")
    pb.add_argument("--dry-run", action="store_true", help="print what would be published; write nothing")
    pb.add_argument("--sign-key", metavar="KEY", help="sign each variant with this PEM private key, or `sigstore` "
                                                      "(keyless, the CI's OIDC identity) (model_signing)")
    pb.add_argument("--plain-http", action="store_true", help="speak plain HTTP to an OCI registry (loopback ones always do)")
    pb.add_argument("--tag", help="hf:// only: the release tag (default quantprep-<index digest>)")
    pb.add_argument("--force", action="store_true", help="replace a destination directory that is not a published reference")
    pb.add_argument("--json", action="store_true")
    pb.set_defaults(func=cmd_publish)

    pl = sub.add_parser("pull", help="copy and verify the variant of a published reference that fits this machine")
    pl.add_argument("ref")
    pl.add_argument("--out", help="default: the local cache (~/.cache/quantprep/pulled, or QUANTPREP_PULL_CACHE)")
    pl.add_argument("--target", help="take this target's variant (cpu, xpu, cuda, openvino) whatever this machine has")
    pl.add_argument("--plain-http", action="store_true", help="speak plain HTTP to an OCI registry (loopback ones always do)")
    pl.add_argument("--verify-key", metavar="PUB", help="refuse unless signed and verified with this PEM public key, or "
                                                        "sigstore:IDENTITY (keyless; issuer QUANTPREP_VERIFY_ISSUER, default GitHub "
                                                        "Actions') (default: QUANTPREP_VERIFY_KEY); a verified signature makes "
                                                        "its kcache trusted")
    pl.add_argument("--force", action="store_true", help="replace an --out directory that is not an artifact")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_pull)

    sg = sub.add_parser("sign", help="sign every file of an artifact (model_signing, key mode): writes DIR/model.sig")
    sg.add_argument("dir")
    sg.add_argument("--key", required=True, help="PEM elliptic-curve private key, or `sigstore` (keyless: the OIDC identity "
                                                 "at hand, e.g. a CI workflow's; needs network)")
    sg.add_argument("--for", dest="for_ref", metavar="REF", help="the reference it will be published to (oci://HOST/REPO:TAG, "
                                                                 "hf://ORG/REPO@TAG, a directory): signed with the files, "
                                                                 "checked at pull (a verify key needs it)")
    sg.set_defaults(func=cmd_sign)

    g = sub.add_parser("generate", help="load an artifact and generate a greedy completion")
    g.add_argument("dir")
    g.add_argument("--prompt", default="What is the capital of France?")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--trust-kcache", action="store_true", help=TRUST_HELP)
    g.add_argument("--native", action="store_true", help="a cpu artifact run by quantprep's C, without torch or transformers "
                                                           "(docs/usage.md, \"Without torch\"; int8 activations at every length)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="serve an artifact with quantprep's bounded OpenAI-compatible server (/v1/chat/completions, ...)")
    sv.add_argument("src", help="artifact dir, or a published reference (pulled and verified first)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--device", default="auto", help="default: the artifact's target device")
    sv.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="run the artifact's warmed shapes once in the serving thread before answering (xpu, cuda)")
    sv.add_argument("--trust-kcache", action="store_true", help=TRUST_HELP)
    sv.add_argument("--verify-key", metavar="PUB", help="refuse unless signed and verified with this key (default: QUANTPREP_VERIFY_KEY)")
    sv.set_defaults(func=cmd_serve)

    args = p.parse_args(argv)
    try:
        return args.func(args)
    except QuantprepError as e:
        _print_error(str(e))
        return 2
    except OSError as e:  # permission, disk full, read-only file system: the environment, not a bug
        where = f"{e.filename}: " if e.filename else ""
        _print_error(f"{where}{e.strerror or e}; check the path's permissions and free space")
        return 2
    except KeyboardInterrupt:
        print("quantprep: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
