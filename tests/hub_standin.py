"""A stand-in for the hugging face hub on loopback, for huggingface_hub pointed at it with
`HF_ENDPOINT`: the model info API (`/api/models/REPO[/revision/REV]`, with files' sizes and
sha256) and file downloads (`/REPO/resolve/REV/PATH`, HEAD and GET with byte ranges), as the
hub answers them, LFS headers included. It records each request (and the Authorization header it
came with), and can send slowly and hang up part-way (`rate`, `cut_after`) to test resumed
downloads. It can also be hostile: file names that lead out of a folder (a repo's keys are its
listing's names as given), another commit or ETag in its headers (`commit`, `HubFile.etag`), no
sha256 in the listing (`HubFile.listed`), a 302 from each file to another server (`redirect`: the
base URL of one, e.g. a second stand-in, that serves `/cdn/REPO/PATH`), and a body that goes on
past the size it announced (`overflow`).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubFile:
    data: bytes
    sha256: str = ""
    advertised: str | None = None  # a different sha256 to announce (a damaged download)
    etag: str | None = None  # an ETag of its own in the download's headers (else the sha256)
    listed: bool = True  # whether the listing names its sha256 (an LFS file's)

    def __post_init__(self) -> None:
        self.sha256 = hashlib.sha256(self.data).hexdigest()


@dataclass
class StandInHub:
    """Repos by id, each a dict of path -> bytes (or a file to read)."""

    repos: dict[str, dict[str, bytes | Path]]
    rate: float | None = None  # bytes per second, None: as fast as it goes
    cut_after: int | None = None  # hang up a GET after sending this many bytes (once)
    commit: str = COMMIT  # the X-Repo-Commit of every download
    redirect: str | None = None  # answer files with a 302 to REDIRECT/cdn/REPO/PATH
    overflow: int | None = None  # a GET sends this many bytes, whatever the file's size
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)  # each request's Authorization header
    sent: int = 0

    def __post_init__(self) -> None:
        self.files = {
            repo: {p: HubFile(d.read_bytes() if isinstance(d, Path) else d) for p, d in files.items()}
            for repo, files in self.repos.items()
        }
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def env(self, cache: Path) -> dict[str, str]:
        """The environment for a process to use this hub with its cache under `cache`."""
        return {
            "HF_ENDPOINT": self.url,
            "HF_HUB_CACHE": str(cache / "hub"),
            "HF_XET_CACHE": str(cache / "xet"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1",
            "HF_TOKEN": "",
        }


def _handler(hub: StandInHub) -> type[BaseHTTPRequestHandler]:
    info_path = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
    tree_path = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)")
    file_path = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
    cdn_path = re.compile(r"^/cdn/([^/]+/[^/]+)/(.+)$")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _error(self, status: int, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _route(self, head: bool) -> None:
            path = self.path.split("?", 1)[0]
            hub.requests.append((self.command, path, self.headers.get("Range")))
            hub.auth.append(self.headers.get("Authorization"))
            if m := info_path.match(path):
                return self._info(m.group(1))
            if m := tree_path.match(path):
                return self._tree(m.group(1))
            if m := file_path.match(path):
                if hub.redirect:
                    return self._redirect(m.group(1), unquote(m.group(3)))
                return self._file(m.group(1), unquote(m.group(3)), head)
            if m := cdn_path.match(path):
                return self._file(m.group(1), unquote(m.group(2)), head)
            return self._error(404, "EntryNotFound", "not found")

        def _info(self, repo: str) -> None:
            files = hub.files.get(repo)
            if files is None:
                return self._error(401, "RepoNotFound", "Repository not found")
            siblings = [
                {
                    "rfilename": p,
                    "size": len(f.data),
                    "blobId": f.sha256[:40],
                    **(
                        {"lfs": {"sha256": f.advertised or f.sha256, "size": len(f.data), "pointerSize": 134}}
                        if f.listed
                        else {}
                    ),
                }
                for p, f in files.items()
            ]
            return self._json({"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings})

        def _json(self, value: object) -> None:
            body = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _tree(self, repo: str) -> None:
            files = hub.files.get(repo)
            if files is None:
                return self._error(401, "RepoNotFound", "Repository not found")
            lfs = {
                p: {"oid": f.advertised or f.sha256, "size": len(f.data), "pointerSize": 134}
                for p, f in files.items()
            }
            return self._json(
                [
                    {
                        "type": "file",
                        "oid": f.sha256[:40],
                        "size": len(f.data),
                        "path": p,
                        **({"lfs": lfs[p]} if f.listed else {}),
                    }
                    for p, f in files.items()
                ]
            )

        def _headers(self, f: HubFile) -> None:
            etag = f'"{f.etag or f.advertised or f.sha256}"'
            self.send_header("ETag", etag)
            self.send_header("X-Linked-Etag", etag)
            self.send_header("X-Linked-Size", str(len(f.data)))
            self.send_header("X-Repo-Commit", hub.commit)

        def _redirect(self, repo: str, name: str) -> None:
            """A 302 to where the file lies, with its metadata, as the hub answers for an LFS file."""
            f = hub.files.get(repo, {}).get(name)
            if f is None:
                return self._error(404, "EntryNotFound", f"{name} does not exist")
            self.send_response(302)
            self._headers(f)
            self.send_header("Location", f"{hub.redirect}/cdn/{repo}/{quote(name)}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _file(self, repo: str, name: str, head: bool) -> None:
            files = hub.files.get(repo)
            if files is None:
                return self._error(401, "RepoNotFound", "Repository not found")
            f = files.get(name)
            if f is None:
                return self._error(404, "EntryNotFound", f"{name} does not exist")
            if hub.overflow is not None and not head:
                return self._endless(f)
            start = 0
            if (r := self.headers.get("Range")) and (m := re.match(r"bytes=(\d+)-", r)):
                start = int(m.group(1))
            data = f.data[start:]
            self.send_response(206 if start else 200)
            self._headers(f)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data)))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(f.data) - 1}/{len(f.data)}")
            self.end_headers()
            if not head:
                self._send(data)

        def _endless(self, f: HubFile) -> None:
            """The file's bytes, then more, `hub.overflow` bytes in all: no Content-Length, the
            body ends where the connection does (or where the client hangs up)."""
            assert hub.overflow is not None
            self.send_response(200)
            self._headers(f)
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            data = f.data + bytes(max(0, hub.overflow - len(f.data)))
            try:
                self._send(data)
            except OSError:  # the client hung up: what it should do
                pass

        def _send(self, data: bytes) -> None:
            step = 1 << 16
            for at in range(0, len(data), step):
                if hub.cut_after is not None and hub.sent >= hub.cut_after:
                    hub.cut_after = None
                    self.close_connection = True
                    self.connection.close()
                    return
                piece = data[at : at + step]
                self.wfile.write(piece)
                hub.sent += len(piece)
                if hub.rate:
                    time.sleep(len(piece) / hub.rate)

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

    return Handler
