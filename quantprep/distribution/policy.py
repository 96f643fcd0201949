"""Signature policy per registry and repository, as users of signed registries expect: for each
reference quantprep pulls, `enforce` (it must be signed for that reference and verify with the
rule's key), `warn` (checked when it can be; a failure is a one-line warning and the pull goes on,
its kcache untrusted) or `off`.

The policy is the user's own file, `$XDG_CONFIG_HOME/quantprep/policy.toml` (QUANTPREP_POLICY names
another); docs/security.md has an example. The first rule whose `match` starts the reference
wins (both compared as policy.canonical spells them); `[default]` applies to the rest. What decides, first to last:

1. a verify key passed for this pull (--verify-key, verify_key=): enforce, with that key;
2. QUANTPREP_SIGNATURES=enforce|warn|off: that mode for every reference (the key from the rule or
   QUANTPREP_VERIFY_KEY), so CI or a serving image can force it;
3. the policy file's rule (or default) for the reference;
4. QUANTPREP_VERIFY_KEY set: enforce; else off.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlparse

from quantprep import settings
from quantprep._io.userdirs import user_dir
from quantprep.distribution.signing import VERIFY_KEY_ENV, verify
from quantprep.errors import ArtifactError, QuantprepError

MODES = ("enforce", "warn", "off")
MODE_ENV = settings.SIGNATURES
MAX_POLICY_BYTES = 1 << 20


def policy_file() -> Path:
    if path := os.environ.get(settings.POLICY):
        return Path(path)
    return user_dir(settings.POLICY, "config") / "policy.toml"


def _mode(value, where: str) -> str:
    if value not in MODES:
        raise QuantprepError(f"{where}: signatures = {value!r}; use one of {', '.join(MODES)}")
    return value


def read_policy(path: Path) -> tuple[list[dict], dict]:
    """(rules, default) of a policy file; a missing file is no rules and default off."""
    if not path.is_file():
        return [], {}
    with open(path, "rb") as f:
        raw = f.read(MAX_POLICY_BYTES + 1)
    if len(raw) > MAX_POLICY_BYTES:
        raise QuantprepError(f"{path}: larger than {MAX_POLICY_BYTES} bytes; a policy is a few rules")
    try:
        data = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise QuantprepError(f"{path}: not valid TOML ({e}); fix the policy file") from None
    rules, default = data.get("rule", []), data.get("default", {})
    if not isinstance(rules, list) or not all(isinstance(r, dict) and isinstance(r.get("match"), str) for r in rules):
        raise QuantprepError(f"{path}: each [[rule]] needs a string `match` (a reference prefix such as oci://HOST/REPO)")
    for i, r in enumerate(rules):
        _mode(r.get("signatures"), f"{path} rule {i + 1} ({r['match']})")
    if default:
        _mode(default.get("signatures"), f"{path} [default]")
    return rules, default


def canonical(ref: str) -> str:
    """A reference (or a rule's prefix of one) as quantprep resolves it, so that a rule matches
    however the reference is spelled: an OCI host lowercased without its default port and the
    path's repeated slashes collapsed, a Hub repository id lowercased, a directory or file:// URL
    as its resolved absolute path."""
    if ref.startswith("oci://"):
        parsed = urlparse(ref)
        try:
            port = f":{parsed.port}" if parsed.port not in (None, 443) else ""
        except ValueError:
            return ref
        return f"oci://{(parsed.hostname or '').lower()}{port}/{re.sub('/+', '/', parsed.path).lstrip('/')}"
    if ref.startswith("hf://"):
        repo, at, revision = ref[len("hf://"):].partition("@")
        return f"hf://{repo.lower()}{at}{revision}"
    if "://" in ref and not ref.startswith("file://"):
        return ref
    path = urlparse(ref).path if ref.startswith("file://") else ref
    return str(Path(os.path.expanduser(path)).resolve()) + ("/" if path.endswith("/") else "")


def signature_policy(ref: str, verify_key: str | os.PathLike | None = None) -> tuple[str, str | None]:
    """(mode, key) for pulling `ref`. enforce without a key is refused in one line."""
    if verify_key:
        return "enforce", str(verify_key)
    path = policy_file()
    rules, default = read_policy(path)
    rule = next((r for r in rules if canonical(ref).startswith(canonical(r["match"]))), default)
    key = rule.get("key") or os.environ.get(VERIFY_KEY_ENV) or None
    if key and not str(key).startswith("sigstore:"):
        key = os.path.expanduser(key)
    forced = os.environ.get(MODE_ENV)
    if forced:
        mode = _mode(forced, MODE_ENV)
    elif rule:
        mode = rule["signatures"]
    else:
        mode = "enforce" if key else "off"
    if mode == "enforce" and not key:
        raise QuantprepError(f"{ref}: signatures are enforced for it ({MODE_ENV} or {path}) but no key is given: add `key` to the "
                             f"rule, set {VERIFY_KEY_ENV} or pass --verify-key")
    return mode, key


def check_signature(path: Path, mode: str, key: str | None, ref: str, asked: dict | None = None) -> bool:
    """The policy's check of `path`, an artifact from `ref`: enforce refuses what does not verify
    (signed for `asked`, when given); warn says so in one line on stderr and goes on, unverified;
    off checks nothing. Whether the signature verified (what lets its kcache run)."""
    if mode == "off":
        return False
    try:
        if key is None:
            raise ArtifactError(f"{ref}: no key to check its signature with (set `key` in the policy or {VERIFY_KEY_ENV})")
        verify(path, key, asked)
        return True
    except QuantprepError as e:
        if mode == "enforce":
            raise
        print(f"quantprep: warning: {e} (signatures: warn for {ref}; its kcache is not trusted by signature)", file=sys.stderr)
        return False
