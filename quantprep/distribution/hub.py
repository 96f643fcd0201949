"""Hugging Face Hub references: hf://ORG/REPO[@REVISION] (docs/publishing.md).

A publish is one commit on the branch (default main): every variant in its own folder, the
quantprep index at the top, other files (a README, a model card) left alone. It is made with one
`create_commit` whose `parent_commit` is the head the publish started from, so it lands whole or
not at all, and not over a commit it has not seen (`upload_folder` splits large folders into
several commits). Each publish is then tagged: the tag names that exact release, as an OCI tag does.

A pull downloads the index, then the chosen variant's manifest, then exactly the files that
manifest lists (never anything else in the folder), each at the index's commit, its size asked
and bounded first, into huggingface_hub's cache (so HF_HUB_OFFLINE=1 works from it); publish.py
copies the files out while hashing each against the manifest: huggingface_hub checks no content
hash, so its cache is never what gets loaded. The endpoint is HF_ENDPOINT; credentials are HF_TOKEN
or huggingface_hub's login.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

from quantprep.errors import ArtifactError, QuantprepError
from quantprep.format.artifact import MANIFEST, SIGNED

DEFAULT_REVISION = "main"


def parse_ref(ref: str) -> tuple[str, str]:
    """hf://org/repo[@revision] -> (repo id, revision)."""
    body = ref.removeprefix("hf://")
    repo_id, _, revision = body.partition("@")
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        raise QuantprepError("hf:// references need huggingface_hub: pip install huggingface_hub") from None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise QuantprepError(f"{ref}: not a Hub reference; write hf://ORG/REPO or hf://ORG/REPO@BRANCH-OR-TAG") from None
    if "/" not in repo_id or (revision == "" and "@" in body):
        raise QuantprepError(f"{ref}: not a Hub reference; write hf://ORG/REPO or hf://ORG/REPO@BRANCH-OR-TAG")
    return repo_id, revision or DEFAULT_REVISION


@contextmanager
def _errors(ref: str, action: str):
    """huggingface_hub's exceptions -> one line naming the reference and what to do."""
    import httpx

    try:  # huggingface_hub 2.x talks through httpx2, a renamed httpx
        import httpx2

        transport_errors: tuple = (httpx.TransportError, httpx2.TransportError)
    except ImportError:
        transport_errors = (httpx.TransportError,)
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = constants.ENDPOINT
    hf_logger = logging.getLogger("huggingface_hub")
    level = hf_logger.level
    hf_logger.setLevel(logging.ERROR)  # its warnings ("No files matched ...") would precede our one line
    try:
        try:
            yield
        except RuntimeError as e:  # huggingface_hub wraps a failed LFS upload: map its cause
            if isinstance(e.__cause__, (HfHubHTTPError, *transport_errors)):
                raise e.__cause__ from None
            raise
    except RevisionNotFoundError:
        raise QuantprepError(f"{ref}: no such branch or tag on {endpoint}; check the part after @") from None
    except RepositoryNotFoundError:
        # Mirrors (olah) answer a missing revision this way too: name both.
        raise QuantprepError(f"{ref}: not found on {endpoint} (the repository{', or the branch or tag after @' if '@' in ref else ''}), "
                             "or no access to it: check the name, set HF_TOKEN or run `hf auth login`") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise QuantprepError(f"{ref}: {endpoint} refused to {action} ({status}); set HF_TOKEN (with write access to "
                                 "publish) or run `hf auth login`") from None
        if status == 412:
            raise QuantprepError(f"{ref}: the branch moved while publishing (someone else committed); nothing was changed: "
                                 "publish again") from None
        raise QuantprepError(f"{ref}: {endpoint} answered {status} to {action}: {str(e).splitlines()[0]}") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, *transport_errors):
        raise QuantprepError(f"{ref}: cannot reach {endpoint} to {action}, and huggingface_hub's cache does not hold it; "
                             "check the network or HF_ENDPOINT") from None
    finally:
        hf_logger.setLevel(level)


def push(variants: list[tuple[Path, dict, str, dict]], index: tuple[str, bytes], ref: str, release: str, tag_given: bool) -> str:
    """variants: (artifact dir, quantprep manifest, variant name, index entry), as registry.push;
    index: the index file's name and bytes. One commit replaces the previous publish's variant folders and index; returns the tagged
    reference hf://ORG/REPO@TAG of this release."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.errors import RevisionNotFoundError

    repo_id, revision = parse_ref(ref)
    files: dict[str, Path | bytes] = {}
    for d, m, name, _ in variants:
        rels = [MANIFEST, *m["files"], *(f"kcache/{rel}" for rel in m.get("kcache", {}).get("files", {}))]
        rels += [s for s in SIGNED if (d / s).is_file()]
        files.update({f"{name}/{rel}": d / rel for rel in rels})
    files[index[0]] = index[1]
    api = HfApi()
    with _errors(ref, "publish"):
        api.create_repo(repo_id, exist_ok=True)
        if tag_given and any(t.name == release for t in api.list_repo_refs(repo_id).tags):
            raise QuantprepError(f"{ref}: tag {release} already names another commit; a release tag is never moved: pass another --tag")
        try:
            head = api.repo_info(repo_id, revision=revision)
        except RevisionNotFoundError:
            api.create_branch(repo_id, branch=revision)
            head = api.repo_info(repo_id, revision=revision)
        existing = [s.rfilename for s in head.siblings or []]
        # A folder with a manifest.json is a variant of an earlier publish: replaced as a whole.
        variant_dirs = {p.split("/")[0] for p in existing if p.count("/") == 1 and p.endswith(f"/{MANIFEST}")}
        variant_dirs |= {name for _, _, name, _ in variants}
        stale = sorted(p for p in existing if p.split("/")[0] in variant_dirs and "/" in p and p not in files)
        ops = [CommitOperationDelete(path_in_repo=p) for p in stale]
        ops += [CommitOperationAdd(path_in_repo=p, path_or_fileobj=src if isinstance(src, bytes) else str(src))
                for p, src in files.items()]
        commit = api.create_commit(repo_id, ops, commit_message=f"quantprep publish: {', '.join(n for _, _, n, _ in variants)}",
                                   revision=revision, parent_commit=head.sha)
        # The default tag is named by the unsigned index's digest: if it exists it names this same content.
        api.create_tag(repo_id, tag=release, revision=commit.oid, exist_ok=not tag_given)
    return f"hf://{repo_id}@{release}"


def _fetch(ref: str, filename: str, revision: str, max_size: int, action: str) -> Path:
    """One file of the repository at `revision`, through huggingface_hub's cache (so that it works
    offline later). Online, its size is asked first (a HEAD) and a file larger than `max_size`
    (what quantprep's manifest lists for it, or the JSON limit) is refused before it is fetched."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url

    repo_id, _ = parse_ref(ref)
    with _errors(ref, action):
        if not constants.is_offline_mode():
            size = get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision)).size
            if size is None or size > max_size:
                raise ArtifactError(f"{ref}: {filename} is {size} bytes on the Hub, more than the {max_size} it may have; refusing it")
        return Path(hf_hub_download(repo_id, filename, revision=revision))


def download_index(ref: str, index_name: str, max_size: int) -> tuple[str, Path]:
    """The commit the reference's revision names and the folder holding its index (in
    huggingface_hub's cache; offline with HF_HUB_OFFLINE=1 when it is there)."""
    from huggingface_hub import HfApi, constants

    repo_id, revision = parse_ref(ref)
    if not constants.is_offline_mode():
        with _errors(ref, "read the index"):
            info = HfApi().repo_info(repo_id, revision=revision)
        if index_name not in {s.rfilename for s in info.siblings or []}:
            raise QuantprepError(f"{ref}: no {index_name}; not a published reference (quantprep publish writes one)")
    # by the revision's name, so that huggingface_hub records it for offline use; the snapshot
    # folder is named by the commit it resolved to, and every later file comes from that commit
    folder = _fetch(ref, index_name, revision, max_size, "read the index").parent
    return folder.name, folder


def download_file(ref: str, commit: str, rel: str, max_size: int) -> Path:
    """One file of a variant folder at `commit` (the index's commit: a publish in between cannot mix
    in): only the files the variant's manifest lists are ever fetched, the manifest first."""
    return _fetch(ref, rel, commit, max_size, f"download {rel}")
