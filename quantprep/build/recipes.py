"""Named recipes: `<name>.toml` in pipelines/ (shipped in the wheel as quantprep.pipelines), or in
the user's own directories (`--recipes DIR`, `QUANTPREP_RECIPES=DIR[:DIR...]`), which are searched
first. Unknown keys are rejected, never ignored.

A recipe says where the model comes from, how to quantize it when it is not already GPTQ, which
targets to build by default, the prompt `build` uses for its fresh-process check, and the serving
shapes `warm` runs (and whether it torch.compiles).
"""

from __future__ import annotations

import importlib.resources
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from quantprep import settings
from quantprep.errors import RecipeError
from quantprep.format.artifact import DEFAULT_SHAPES
from quantprep.format.gptq import SUPPORTED_BITS

PIPELINES_DIR = Path(str(importlib.resources.files("quantprep.pipelines")))  # pipelines/ in the repository, in the wheel

SCHEMA: dict[str, dict[str, type | tuple]] = {
    "": {"name": str, "description": str},
    "source": {"gguf_package": str, "gguf_file": str, "gguf_parts": list, "gguf_sha256": str, "hub": str, "revision": str,
               "path": str},
    "quantize": {"bits": int, "group_size": int, "desc_act": bool, "sym": bool, "calibration": str,
                 "samples": int, "seq_len": int, "seed": int},
    "build": {"targets": list, "act_dtype": str, "prompt": str, "max_new_tokens": int, "lm_head": str},
    "warm": {"shapes": list, "compile": bool, "aot": bool, "enabled": bool},
}


@dataclass
class Recipe:
    name: str
    description: str
    source: dict
    bits: int = 4
    group_size: int = 128
    desc_act: bool = True
    sym: bool = True
    calibration: str = "builtin"
    samples: int = 17
    seq_len: int | None = None  # calibration windows of exactly this many tokens; None: one text per sample
    seed: int = 0
    targets: list[str] = field(default_factory=lambda: ["cpu"])
    act_dtype: str | None = None
    prompt: str = "What is the capital of France?"
    max_new_tokens: int = 16
    lm_head: str = "float"  # or "int8", "int4": build/lm_head.py (checked there)
    warm_shapes: list[int] = field(default_factory=lambda: list(DEFAULT_SHAPES))
    warm_compile: bool = False
    warm_aot: bool = True  # with compile: also ship compiled packages of the MLPs (aot.py)
    warm_enabled: bool = True  # build warms each artifact whose device is present
    path: Path | None = None


def _check_table(where: str, table: dict, section: str) -> None:
    allowed = SCHEMA[section]
    for key, value in table.items():
        if section == "" and key in SCHEMA and isinstance(value, dict):
            continue
        if key not in allowed:
            sect = f"[{section}] " if section else ""
            raise RecipeError(f"{where}: unknown key {sect}{key!r}; allowed: {', '.join(allowed)}")
        typ = allowed[key]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise RecipeError(f"{where}: {section + '.' if section else ''}{key} must be a {typ.__name__}, got {value!r}")


def parse_recipe(path: Path) -> Recipe:
    where = str(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{where}: malformed TOML ({e})") from None
    except OSError as e:
        raise RecipeError(f"{where}: cannot read ({e.strerror})") from None
    _check_table(where, data, "")
    for section in ("source", "quantize", "build", "warm"):
        if section in data:
            if not isinstance(data[section], dict):
                raise RecipeError(f"{where}: [{section}] must be a table")
            _check_table(where, data[section], section)
    src = data.get("source", {})
    kinds = [k for k in ("gguf_package", "gguf_parts", "hub", "path") if k in src]
    if len(kinds) != 1:
        raise RecipeError(f"{where}: [source] needs exactly one of gguf_package, gguf_parts, hub, path (got {kinds or 'none'})")
    if "gguf_parts" in src and not (src["gguf_parts"] and all(isinstance(x, str) for x in src["gguf_parts"])
                                    and len(src.get("gguf_sha256", "")) == 64):
        raise RecipeError(f"{where}: source.gguf_parts must be a list of package names, with source.gguf_sha256 "
                          "(the assembled file's sha256)")
    q, b, w = data.get("quantize", {}), data.get("build", {}), data.get("warm", {})
    r = Recipe(name=data.get("name", path.stem), description=data.get("description", ""), source=src,
               path=path, **q, **b, **{f"warm_{k}": v for k, v in w.items()})
    if r.calibration.endswith((".txt", ".jsonl")) and not Path(r.calibration).is_absolute():
        r.calibration = str((path.parent / r.calibration).resolve())  # relative to the recipe file
    if r.samples < 1 or (r.seq_len is not None and r.seq_len < 1):
        raise RecipeError(f"{where}: quantize.samples and quantize.seq_len must be positive")
    if r.bits not in SUPPORTED_BITS:
        raise RecipeError(f"{where}: quantize.bits must be one of {SUPPORTED_BITS}, got {r.bits}")
    if r.group_size not in (-1, 32, 64, 128):
        raise RecipeError(f"{where}: quantize.group_size must be -1, 32, 64 or 128, got {r.group_size}")
    if r.act_dtype not in (None, "bfloat16", "float16", "float32"):
        raise RecipeError(f"{where}: build.act_dtype must be bfloat16, float16 or float32, got {r.act_dtype!r}")
    if not r.warm_shapes or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in r.warm_shapes):
        raise RecipeError(f"{where}: warm.shapes must be a non-empty list of positive prefill lengths")
    if not all(isinstance(t, str) for t in r.targets) or not r.targets:
        raise RecipeError(f"{where}: build.targets must be a non-empty list of target names")
    return r


def recipe_dirs(extra: list[str] | None = None) -> list[Path]:
    """Where recipes are looked up, first match wins: `extra` (--recipes), QUANTPREP_RECIPES, the built-in ones."""
    user = [*(extra or []), *filter(None, os.environ.get(settings.RECIPES, "").split(os.pathsep))]
    for d in user:
        if not Path(d).is_dir():
            raise RecipeError(f"{d}: recipe directory does not exist (from --recipes or QUANTPREP_RECIPES)")
    return [*map(Path, user), PIPELINES_DIR]


def list_recipes(extra: list[str] | None = None) -> list[Path]:
    """One file per recipe name, the first found in recipe_dirs order."""
    found: dict[str, Path] = {}
    for d in recipe_dirs(extra):
        for p in sorted(d.glob("*.toml")):
            found.setdefault(p.stem, p)
    return sorted(found.values(), key=lambda p: p.stem)


def find_recipe(name_or_path: str, extra: list[str] | None = None) -> Recipe:
    p = Path(name_or_path)
    if p.suffix == ".toml":
        if not p.is_file():
            raise RecipeError(f"{p}: recipe file does not exist")
        return parse_recipe(p)
    for candidate in list_recipes(extra):
        if candidate.stem == name_or_path:
            return parse_recipe(candidate)
    known = ", ".join(x.stem for x in list_recipes(extra))
    raise RecipeError(f"unknown recipe {name_or_path!r}; known: {known} (or pass a path to a .toml file, or --recipes DIR)")
