"""Every environment variable quantprep reads, and what it does: one home for their names.

User state (userdirs.py; each defaults to an XDG directory):
    QUANTPREP_TRUST_DIR      trusted kcache digests (kcache.py)
    QUANTPREP_KCACHE_DIR     private runtime copies of kcaches (kcache.py)
    QUANTPREP_VERIFIED_DIR   marks of artifacts hashed in full here (verified.py)
    QUANTPREP_PULL_CACHE     pulled artifacts (publish.py)
    QUANTPREP_POLICY         the signature policy file (policy.py)
    QUANTPREP_NATIVE_DIR     quantprep's own C kernels, compiled here (targets/c_library.py)
Trust:
    QUANTPREP_TRUST_KCACHE   1: run any artifact's kcache (kcache.trust_reason)
    QUANTPREP_VERIFY_KEY     a PEM public key or sigstore:IDENTITY that signatures must verify with
    QUANTPREP_VERIFY_ISSUER  the OIDC issuer of sigstore identities (default GitHub Actions')
    QUANTPREP_SIGNATURES     enforce | warn | off for every reference (policy.py)
Build:
    QUANTPREP_RECIPES        more recipe directories, searched first (recipes.py)
    QUANTPREP_CACHE          the build cache (default artifacts/.cache; build/pipeline.py)
    QUANTPREP_PACK           `torch`: the cpu target packs with tensor ops, not its compiled packer
Run:
    QUANTPREP_NATIVE         `0`: no C kernel is compiled or loaded; tensor ops instead (targets/c_library.py)
"""

TRUST_DIR = "QUANTPREP_TRUST_DIR"
KCACHE_DIR = "QUANTPREP_KCACHE_DIR"
VERIFIED_DIR = "QUANTPREP_VERIFIED_DIR"
PULL_CACHE = "QUANTPREP_PULL_CACHE"
POLICY = "QUANTPREP_POLICY"
TRUST_KCACHE = "QUANTPREP_TRUST_KCACHE"
VERIFY_KEY = "QUANTPREP_VERIFY_KEY"
VERIFY_ISSUER = "QUANTPREP_VERIFY_ISSUER"
SIGNATURES = "QUANTPREP_SIGNATURES"
RECIPES = "QUANTPREP_RECIPES"
CACHE = "QUANTPREP_CACHE"
PACK = "QUANTPREP_PACK"
NATIVE = "QUANTPREP_NATIVE"
NATIVE_DIR = "QUANTPREP_NATIVE_DIR"
