"""A small Hugging Face Hub for tests: the HTTP endpoints that huggingface_hub 2.4 and transformers call.

Only the standard library, PyYAML and the ``git`` command. Each repository is a bare git repository at
``ROOT/models/ORG/NAME`` (the layout olah serves as local mirrors), so commit hashes are real and
``revision=<sha>`` pinning works. Uploads are always "regular" (base64 in the NDJSON commit), never
LFS or Xet, which is how the client behaves for any file the server calls regular.

Endpoints (model repositories only):
    GET  /api/whoami-v2
    GET  /api/agent-harnesses                       an empty registry (each client process asks once)
    POST /api/repos/create                          409 if the repository exists
    POST /api/validate-yaml                         the README's metadata block
    GET  /api/models/R, /api/models/R/revision/REV  model info: sha, siblings, cardData
    GET  /api/models/R/refs                         branches and tags
    GET  /api/models/R/tree/REV[/PATH]              file listing
    POST /api/models/R/branch/BRANCH                create a branch (from "startingPoint" or main)
    POST /api/models/R/preupload/REV                every file "regular"
    POST /api/models/R/commit/REV                   NDJSON: header, file, deletedFile, deletedFolder
    HEAD, GET /R/resolve/REV/PATH                   ETag (git blob id), X-Repo-Commit, Content-Length

Errors carry the ``X-Error-Code`` header that ``huggingface_hub.utils.hf_raise_for_status`` maps to
its exceptions: RepoNotFound, RevisionNotFound, EntryNotFound. Private repositories answer
RepoNotFound to requests without the token, like the Hub does.

    with HubServer(tmp_path) as hub:   # hub.url is http://127.0.0.1:PORT, hub.token the write token
        ...
"""

import base64
import json
import os
import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

USER = "decoderlab-tester"
ORGS = ("decoderlab-org",)
TOKEN = "hf_decoderlab_test_token"
NULL_SHA = "0" * 40
REPO_ID = r"(?P<repo>[\w.-]+/[\w.-]+)"
README_METADATA = re.compile(r"\A\s*---\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.S)


class HubError(Exception):
    """An HTTP error answer: status, the X-Error-Code header (if any) and a message."""

    def __init__(self, status: int, message: str, code: str | None = None, **data):
        super().__init__(message)
        self.status, self.code, self.message, self.data = status, code, message, data


class EntryNotFound(HubError):
    """404 for an absent file; carries the commit so the client can cache the file's absence."""

    def __init__(self, path: str, commit: str):
        super().__init__(404, f"Entry not found: {path}", "EntryNotFound")
        self.commit = commit


class GitRepo:
    """One bare git repository, driven through git plumbing commands."""

    def __init__(self, path: Path):
        self.path = path
        self.env = {
            **os.environ,
            "GIT_DIR": str(path),
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": USER,
            "GIT_AUTHOR_EMAIL": f"{USER}@localhost",
            "GIT_COMMITTER_NAME": "hub_server",
            "GIT_COMMITTER_EMAIL": "hub_server@localhost",
        }

    def git(self, *args: str, input: bytes | None = None, env: dict | None = None, check: bool = True) -> bytes:
        result = subprocess.run(
            ["git", *args], input=input, env={**self.env, **(env or {})}, capture_output=True, check=False
        )
        if check and result.returncode:
            raise RuntimeError(f"git {' '.join(args)} failed: {result.stderr.decode(errors='replace')}")
        return result.stdout

    @classmethod
    def create(cls, path: Path, *, private: bool) -> "GitRepo":
        path.mkdir(parents=True)
        repo = cls(path)
        repo.git("init", "--quiet", "--bare", "--initial-branch=main", str(path))
        repo.git("config", "hub.private", str(private).lower())
        # The Hub starts every repository with one commit, so "main" exists before the first upload
        repo.commit("main", {".gitattributes": b"# decoderlab test hub: every file is a regular git blob\n"},
                    deleted_files=[], deleted_folders=[], message="initial commit")  # fmt: skip
        return repo

    @property
    def private(self) -> bool:
        return self.git("config", "--get", "hub.private").strip() == b"true"

    def resolve(self, revision: str) -> str | None:
        """A branch, tag or (full) commit hash -> the commit hash, or None."""
        if re.fullmatch(r"[0-9a-f]{40}", revision):
            candidates = [revision]
        else:  # never let a branch name be read as an abbreviated hash
            candidates = [f"refs/heads/{revision}", f"refs/tags/{revision}", revision]
        for candidate in candidates:
            out = self.git("rev-parse", "--verify", "--quiet", f"{candidate}^{{commit}}", check=False).strip()
            if out:
                return out.decode()
        return None

    def files(self, commit: str) -> dict[str, tuple[str, int]]:
        """{path: (blob id, size)} of every file in the commit."""
        out = self.git("ls-tree", "-r", "-l", "-z", commit)
        files = {}
        for entry in filter(None, out.split(b"\0")):
            meta, path = entry.split(b"\t", 1)
            _mode, _type, blob, size = meta.split()
            files[path.decode()] = (blob.decode(), int(size))
        return files

    def read(self, blob: str) -> bytes:
        return self.git("cat-file", "blob", blob)

    def refs(self, prefix: str) -> dict[str, str]:
        """{name: commit} of the refs under ``refs/heads/`` or ``refs/tags/``."""
        out = self.git("for-each-ref", "--format=%(refname) %(objectname)", prefix)
        refs = {}
        for line in out.decode().splitlines():
            ref, sha = line.split()
            refs[ref.removeprefix(prefix)] = sha
        return refs

    def commit_time(self, commit: str) -> str:
        seconds = int(self.git("show", "-s", "--format=%ct", commit).strip())
        return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(seconds))

    def commit(
        self,
        branch: str,
        added: dict[str, bytes],
        *,
        deleted_files: list[str],
        deleted_folders: list[str],
        message: str,
        parent_commit: str | None = None,
    ) -> str:
        ref = f"refs/heads/{branch}"
        parent = self.resolve(branch)
        if parent_commit is not None and parent_commit != parent:
            raise HubError(412, f"parentCommit {parent_commit} is not the head of {branch!r} ({parent}).")
        index = {"GIT_INDEX_FILE": str(self.path / f"index-{threading.get_ident()}")}
        self.git("read-tree", *([parent] if parent else ["--empty"]), env=index)
        present = set(self.files(parent)) if parent else set()
        gone = [p for p in deleted_files if p in present]
        gone += [p for folder in deleted_folders for p in present if p.startswith(folder.rstrip("/") + "/")]
        lines = [f"0 {NULL_SHA}\t{path}" for path in gone]
        for path, data in added.items():
            blob = self.git("hash-object", "-w", "--stdin", input=data).decode().strip()
            lines.append(f"100644 {blob}\t{path}")
        self.git("update-index", "--index-info", input="".join(f"{line}\n" for line in lines).encode(), env=index)
        tree = self.git("write-tree", env=index).decode().strip()
        os.remove(index["GIT_INDEX_FILE"])
        sha = self.git("commit-tree", tree, *(["-p", parent] if parent else []), "-m", message).decode().strip()
        self.git("update-ref", ref, sha, parent or NULL_SHA)
        return sha


def check_path(path: str) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(part in ("", ".", "..", ".git") for part in parts):
        raise HubError(400, f"Invalid path in repository: {path!r}.")
    return path


def validate_metadata(content: str) -> tuple[list[str], list[str]]:
    """Errors and warnings for a README's YAML block, checked the way the Hub documents its fields."""
    match = README_METADATA.match(content)
    if match is None:
        return [], ["Empty or missing yaml metadata in repo card"]
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError as err:
        return [f"Invalid YAML in the metadata block: {err}"], []
    if not isinstance(data, dict):
        return ["The metadata block must be a YAML mapping."], []
    errors = []
    for key in ("license", "library_name", "pipeline_tag"):
        if key in data and not isinstance(data[key], str):
            errors.append(f'"{key}" must be a string, got {data[key]!r}.')
    for key in ("tags", "datasets", "base_model", "language"):
        value = data.get(key, [])
        if not all(isinstance(v, str) for v in (value if isinstance(value, list) else [value])):
            errors.append(f'"{key}" must be a string or a list of strings, got {value!r}.')
    for entry in data.get("model-index", []):
        for result in entry.get("results", []) if isinstance(entry, dict) else [None]:
            if not (
                isinstance(result, dict)
                and isinstance(result.get("task", {}).get("type"), str)
                and {"type", "name"} <= set(result.get("dataset", {}))
                and result.get("metrics")
                and all({"type", "value"} <= set(m) for m in result["metrics"])
            ):
                errors.append(
                    f'"model-index" result {result!r} needs task.type, dataset.type/name, metrics[].type/value.'
                )
        if not isinstance(entry, dict) or "name" not in entry:
            errors.append(f'"model-index" entry {entry!r} needs a "name".')
    return errors, []


class HubServer:
    """The test Hub on 127.0.0.1 with a free port, serving (and storing under) ``root``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.token = TOKEN
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, for assertions
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.hub = self
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="hub_server", daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def read(self, repo_id: str, revision: str, path: str) -> bytes:
        """A stored file, read straight from git (for test assertions: no client, no cache)."""
        repo = GitRepo(self.repo_path(repo_id))
        return repo.read(repo.files(repo.resolve(revision))[path][0])

    def repo_path(self, repo_id: str) -> Path:
        return self.root / "models" / repo_id

    def repo(self, repo_id: str, token: str | None) -> GitRepo:
        path = self.repo_path(repo_id)
        if not (path / "HEAD").exists():
            raise HubError(404, f"Repository {repo_id} not found.", "RepoNotFound")
        repo = GitRepo(path)
        if repo.private and token != self.token:
            raise HubError(401, f"Repository {repo_id} not found.", "RepoNotFound")
        return repo

    def resolve(self, repo: GitRepo, revision: str) -> str:
        sha = repo.resolve(revision)
        if sha is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return sha

    def require_token(self, token: str | None) -> None:
        if token != self.token:
            raise HubError(401, "Invalid credentials in Authorization header")

    def require_namespace(self, repo_id: str) -> None:
        if repo_id.split("/")[0] not in (USER, *ORGS):
            raise HubError(403, f"You don't have the rights to create a model under the namespace {repo_id!r}.")

    # ------------------------------------------------------------------------------------------
    # Endpoints: each takes (match, query, body, token) and returns (status, headers, body)

    def whoami(self, m, query, body, token):
        self.require_token(token)
        orgs = [{"type": "org", "name": org, "roleInOrg": "write"} for org in ORGS]
        return json_response({"type": "user", "name": USER, "orgs": orgs, "auth": {"type": "access_token"}})

    def agent_harnesses(self, m, query, body, token):
        # huggingface_hub fetches this registry from its endpoint to name the calling agent in its User-Agent
        return json_response({"standardEnvVars": [], "harnesses": {}})

    def create_repo(self, m, query, body, token):
        self.require_token(token)
        payload = json.loads(body)
        if payload.get("type", "model") != "model":
            raise HubError(400, f"This test hub stores model repositories only, got type={payload['type']!r}.")
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        self.require_namespace(repo_id)
        check_path(repo_id)
        with self.lock:
            if self.repo_path(repo_id).exists():
                raise HubError(409, "You already created this model repo", url=f"{self.url}/{repo_id}")
            GitRepo.create(self.repo_path(repo_id), private=payload.get("visibility") == "private")
        return json_response({"url": f"{self.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def validate_yaml(self, m, query, body, token):
        errors, warnings = validate_metadata(json.loads(body)["content"])
        status = 400 if errors else 200
        as_list = lambda messages: [{"message": message} for message in messages]
        return json_response({"errors": as_list(errors), "warnings": as_list(warnings)}, status)

    def model_info(self, m, query, body, token):
        repo = self.repo(m["repo"], token)
        sha = self.resolve(repo, unquote(m["revision"] or "main"))
        files = repo.files(sha)
        card_data = None
        if "README.md" in files:
            readme = repo.read(files["README.md"][0]).decode()
            if match := README_METADATA.match(readme):
                card_data = yaml.safe_load(match.group(1))
        author = m["repo"].split("/")[0]
        info = {
            "id": m["repo"], "author": author, "sha": sha, "private": repo.private, "gated": False,
            "disabled": False, "lastModified": repo.commit_time(sha), "tags": (card_data or {}).get("tags", []),
            "cardData": card_data, "siblings": [
                {"rfilename": path, **({"size": size, "blobId": blob} if "blobs" in query else {})}
                for path, (blob, size) in files.items()
            ],
        }  # fmt: skip
        for key in ("library_name", "pipeline_tag"):
            if card_data and key in card_data:
                info[key] = card_data[key]
        return json_response(info)

    def refs(self, m, query, body, token):
        repo = self.repo(m["repo"], token)
        as_refs = lambda kind, refs: [
            {"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": sha} for name, sha in refs.items()
        ]
        return json_response({
            "branches": as_refs("heads", repo.refs("refs/heads/")), "tags": as_refs("tags", repo.refs("refs/tags/")),
            "converts": [], "pullRequests": [],
        })  # fmt: skip

    def tree(self, m, query, body, token):
        repo = self.repo(m["repo"], token)
        sha = self.resolve(repo, unquote(m["revision"]))
        prefix = unquote(m["path"] or "").strip("/")
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        entries, folders = [], set()
        for path, (blob, size) in sorted(repo.files(sha).items()):
            if prefix and not path.startswith(prefix + "/"):
                continue
            rest = path[len(prefix) + 1 :] if prefix else path
            if "/" in rest and not recursive:
                folders.add(f"{prefix}/{rest.split('/')[0]}".lstrip("/"))
                continue
            entries.append({"type": "file", "oid": blob, "size": size, "path": path})
        if prefix and not entries and not folders:
            raise HubError(404, f"{prefix} does not exist on {m['revision']}", "EntryNotFound")
        entries += [{"type": "directory", "oid": NULL_SHA, "size": 0, "path": folder} for folder in sorted(folders)]
        return json_response(entries)

    def create_branch(self, m, query, body, token):
        self.require_token(token)
        repo = self.repo(m["repo"], token)
        branch = unquote(m["branch"])
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*", branch) or branch.startswith("refs"):
            raise HubError(400, f"Invalid branch name {branch!r}.")
        start = json.loads(body or b"{}").get("startingPoint") or "main"
        with self.lock:
            if repo.resolve(f"refs/heads/{branch}"):
                raise HubError(409, f"Reference refs/heads/{branch} already exists")
            repo.git("update-ref", f"refs/heads/{branch}", self.resolve(repo, start), NULL_SHA)
        return json_response({})

    def preupload(self, m, query, body, token):
        self.require_token(token)
        repo = self.repo(m["repo"], token)
        existing = repo.files(self.resolve(repo, unquote(m["revision"])))
        files = [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
             "oid": existing.get(check_path(f["path"]), (None,))[0]}
            for f in json.loads(body)["files"]
        ]  # fmt: skip
        return json_response({"files": files, "commitOid": None})

    def create_commit(self, m, query, body, token):
        self.require_token(token)
        repo = self.repo(m["repo"], token)
        branch = unquote(m["revision"])
        if "create_pr" in query:
            raise HubError(400, "This test hub does not open pull requests.")
        header, added, deleted_files, deleted_folders = {}, {}, [], []
        for line in filter(None, body.splitlines()):
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file" and value.get("encoding") == "base64":
                added[check_path(value["path"])] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                deleted_files.append(check_path(value["path"]))
            elif key == "deletedFolder":
                deleted_folders.append(check_path(value["path"].rstrip("/")))
            else:
                raise HubError(400, f"This test hub takes regular base64 files only, got a {key!r} operation.")
        with self.lock:
            if repo.resolve(f"refs/heads/{branch}") is None:
                raise HubError(404, f"Invalid rev id: {branch} is not a branch", "RevisionNotFound")
            message = "\n\n".join(filter(None, (header.get("summary"), header.get("description"))))
            sha = repo.commit(
                branch, added, deleted_files=deleted_files, deleted_folders=deleted_folders,
                message=message or "commit", parent_commit=header.get("parentCommit"),
            )  # fmt: skip
        return json_response({"commitUrl": f"{self.url}/{m['repo']}/commit/{sha}", "commitOid": sha, "success": True})

    def resolve_file(self, m, query, body, token):
        repo = self.repo(m["repo"], token)
        sha = self.resolve(repo, unquote(m["revision"]))
        path = unquote(m["path"])
        entry = repo.files(sha).get(path)
        if entry is None:
            raise EntryNotFound(path, sha)
        blob, size = entry
        headers = {
            "ETag": f'"{blob}"',
            "X-Repo-Commit": sha,
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "none",
        }
        return 200, headers, repo.read(blob), size


def json_response(data, status: int = 200):
    body = json.dumps(data).encode()
    return status, {"Content-Type": "application/json"}, body, len(body)


ROUTES = [
    ("GET", r"/api/whoami-v2", HubServer.whoami),
    ("GET", r"/api/agent-harnesses", HubServer.agent_harnesses),
    ("POST", r"/api/repos/create", HubServer.create_repo),
    ("POST", r"/api/validate-yaml", HubServer.validate_yaml),
    ("GET", rf"/api/models/{REPO_ID}(?:/revision/(?P<revision>[^/]+))?", HubServer.model_info),
    ("GET", rf"/api/models/{REPO_ID}/refs", HubServer.refs),
    ("GET", rf"/api/models/{REPO_ID}/tree/(?P<revision>[^/]+)(?:/(?P<path>.+))?", HubServer.tree),
    ("POST", rf"/api/models/{REPO_ID}/branch/(?P<branch>[^/]+)", HubServer.create_branch),
    ("POST", rf"/api/models/{REPO_ID}/preupload/(?P<revision>[^/]+)", HubServer.preupload),
    ("POST", rf"/api/models/{REPO_ID}/commit/(?P<revision>[^/]+)", HubServer.create_commit),
    ("GET", rf"/{REPO_ID}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", HubServer.resolve_file),
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every answer has a Content-Length

    def do_GET(self):
        self.answer("GET")

    def do_HEAD(self):
        self.answer("GET", head=True)

    def do_POST(self):
        self.answer("POST")

    def answer(self, method: str, head: bool = False) -> None:
        hub: HubServer = self.server.hub
        url = urlsplit(self.path)
        hub.requests.append(("HEAD" if head else method, url.path))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        try:
            for route_method, pattern, endpoint in ROUTES:
                match = re.fullmatch(pattern, url.path)
                if route_method == method and match:
                    status, headers, content, size = endpoint(hub, match, parse_qs(url.query), body, token)
                    break
            else:
                raise HubError(404, f"The test hub has no route for {method} {url.path}.")
        except HubError as err:
            content = json.dumps({"error": err.message, **err.data}).encode()
            status, size, headers = err.status, len(content), {"Content-Type": "application/json"}
            if err.code:
                headers["X-Error-Code"] = err.code
            headers["X-Error-Message"] = err.message
            if isinstance(err, EntryNotFound):
                headers["X-Repo-Commit"] = err.commit
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(size)}.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(content)

    def log_message(self, format, *args):  # the request list replaces the stderr log
        pass
