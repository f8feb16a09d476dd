"""A stand-in for the Hugging Face Hub's HTTP API, enough for huggingface_hub's `snapshot_download`
and `hf_hub_download`: the routes they call, answered as the hub answers them.

    GET  /api/models/{repo}[/revision/{rev}]      model info: "sha" (the commit) and "siblings"
    GET  /api/models/{repo}/tree/{rev}[/{path}]   the commit's files ("type", "path", "size", "oid")
    HEAD /{repo}/resolve/{rev}/{path}             X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{path}             the bytes; a Range ("bytes=N-") gets a 206

Errors carry the `X-Error-Code` header that huggingface_hub maps to its exceptions: RepoNotFound
(404), RevisionNotFound (404), EntryNotFound (404), GatedRepo (401 without the repository's token in
`Authorization: Bearer ...`). Nothing advertises Xet storage, so downloads are plain HTTP.
Point huggingface_hub at it with HF_ENDPOINT=`Hub.url` (read when huggingface_hub is imported).
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import pathlib
import re
import threading
import urllib.parse


@dataclasses.dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)  # commit -> {path: bytes}
    refs: dict[str, str] = dataclasses.field(default_factory=dict)  # branch or tag -> commit
    token: str | None = None  # a gated repository's files need it
    unserved: set[str] = dataclasses.field(default_factory=set)  # listed, but answered 404 EntryNotFound


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    path: str  # unquoted, without the query
    range: str | None
    authorization: str | None


class Hub:
    """The stand-in hub on 127.0.0.1, answering on a thread of its own until `close()`."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self._cuts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.hub = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def publish(self, repo_id: str, folder: pathlib.Path, *, revision: str = "main", token: str | None = None) -> str:
        """Adds `folder`'s files to `repo_id` as a new commit that branch or tag `revision` names;
        returns the commit's hash. `token`: the repository is gated, and its files need this token."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        digest = hashlib.sha1(repo_id.encode() + revision.encode())
        for name, data in files.items():
            digest.update(name.encode() + hashlib.sha1(data).digest())
        commit = digest.hexdigest()
        with self._lock:
            repo = self.repos.setdefault(repo_id, Repo())
            repo.commits[commit] = files
            repo.refs[revision] = commit
            repo.token = token or repo.token
        return commit

    def cut(self, repo_id: str, path: str, after: int) -> None:
        """The next GET of `path` sends its headers and `after` bytes of the body, then drops the connection."""
        with self._lock:
            self._cuts[(repo_id, path)] = after

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


_INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?")
_TREE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/.*)?")
_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")


class _Handler(http.server.BaseHTTPRequestHandler):
    @property
    def hub(self) -> Hub:
        return self.server.hub

    def log_message(self, format, *args):  # quiet: the test reads `Hub.requests`
        pass

    def do_HEAD(self):
        self._answer(head=True)

    def do_GET(self):
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        # Revisions come quoted with safe="" ("refs%2Fpr%2F1"): match first, then unquote each part.
        raw = urllib.parse.urlsplit(self.path).path
        hub = self.hub
        with hub._lock:
            hub.requests.append(
                Request(
                    self.command,
                    urllib.parse.unquote(raw),
                    self.headers.get("Range"),
                    self.headers.get("Authorization"),
                )
            )
        for pattern, route in ((_TREE, self._tree), (_INFO, self._info), (_RESOLVE, self._file)):
            match = pattern.fullmatch(raw)
            if match:
                parts = {k: urllib.parse.unquote(v) if v else v for k, v in match.groupdict().items()}
                repo = hub.repos.get(parts["repo"])
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found", head=head)
                commit = self._commit(repo, parts.get("rev") or "main")
                if commit is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {parts['rev']}", head=head)
                return route(parts, repo, commit, head)
        self._error(404, None, "Sorry, we can't find the page you are looking for.", head=head)

    @staticmethod
    def _commit(repo: Repo, revision: str) -> str | None:
        return revision if revision in repo.commits else repo.refs.get(revision)

    def _info(self, parts, repo: Repo, commit: str, head: bool) -> None:
        info = {
            "id": parts["repo"],
            "modelId": parts["repo"],
            "sha": commit,
            "private": False,
            "gated": "manual" if repo.token else False,
            "disabled": False,
            "tags": [],
            "siblings": [{"rfilename": name} for name in repo.commits[commit]],
        }
        self._json(info, head=head)

    def _tree(self, parts, repo: Repo, commit: str, head: bool) -> None:
        entries = [
            {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            for name, data in repo.commits[commit].items()
        ]
        self._json(entries, head=head)

    def _file(self, parts, repo: Repo, commit: str, head: bool) -> None:
        name = parts["file"]
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            message = (
                f"Access to model {parts['repo']} is restricted. You must have access to it and be authenticated "
                "to access it. Please log in."
            )
            return self._error(401, "GatedRepo", message, head=head)
        data = repo.commits[commit].get(name)
        if data is None or name in repo.unserved:
            return self._error(404, "EntryNotFound", f'{name} does not exist on "{commit}"', head=head, commit=commit)
        start, status = 0, 200
        asked = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if asked:
            start, status = int(asked.group(1)), 206
        body = data[start:]
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", commit)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        with self.hub._lock:
            after = self.hub._cuts.pop((parts["repo"], name), None)
        if after is not None:
            self.wfile.write(body[:after])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def _json(self, value, *, head: bool) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str, *, head: bool, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if not head:
            self.wfile.write(body)
