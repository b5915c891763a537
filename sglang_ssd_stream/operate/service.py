"""Service files: the write-up's systemd unit (000 §5) and the vLLM compose file (002).

Both run what ``serve`` runs: the unit calls ``<cli> serve --profile …`` (so the preflight and the
profile table stay the single source), and the compose command is built by ``launch.build_launch``.
"""

from __future__ import annotations

import json
import re

from .. import __version__
from ..ple_metrics.publish import MULTIPROC_ENV
from .errors import ServeRefused
from .launch import build_launch, check_exposure
from .profiles import Profile
from .side import EngineSide

_SYSTEMD_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def systemd_quote(arg: str) -> str:
    """Quote one ExecStart word for systemd: specifiers (%) and variables ($) are escaped."""
    if any(c in arg for c in "\n\r\0"):
        raise ServeRefused(f"a unit argument cannot hold a newline or NUL: {arg!r}")
    arg = arg.replace("%", "%%").replace("$", "$$")
    if _SYSTEMD_SAFE.match(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_systemd(*, name: str, description: str, user: str, group: str | None, workdir: str, home: str,
                   exec_argv: list[str], environment: dict[str, str] | None = None) -> str:
    env_lines = "".join(f"Environment={systemd_quote(f'{k}={v}')}\n"
                        for k, v in {"HOME": home, **(environment or {})}.items())
    return (
        "[Unit]\n"
        f"Description={description}\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"User={user}\n"
        f"Group={group or user}\n"
        f"WorkingDirectory={systemd_quote(workdir)}\n"
        f"{env_lines}"
        f"ExecStart={' '.join(systemd_quote(a) for a in exec_argv)}\n"
        # always, not on-failure: a launcher may exit 0 after its engine died (vLLM's API server does when its
        # engine core is killed); a `systemctl stop` is never restarted either way
        "Restart=always\n"
        "RestartSec=10\n"
        "TimeoutStopSec=90\n"  # the engine drains and frees ~90 GB of unified memory
        # SIGTERM to serve alone, which passes it to the engine's process group once (operate/supervise.py); after
        # TimeoutStopSec every process left in the unit's cgroup gets SIGKILL: none outlives the unit
        "KillMode=mixed\n"
        "LimitMEMLOCK=infinity\n"  # pinned host buffers (PLE staging, CUDA graphs)
        "StandardOutput=journal\n"
        "StandardError=journal\n"
        f"SyslogIdentifier={name}\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def _y(value) -> str:
    """A YAML scalar: JSON strings and numbers are valid YAML and never re-interpreted."""
    return json.dumps(value)


API_KEY_ENV = "VLLM_API_KEY"
# The compose file's default image: this kit's own runtime (install.sh from the hash locks, patches applied and
# verified at build time), built from the kit's repository; the tag is the kit's version.
IMAGE_DOCKERFILE = "scripts/docker/vllm-runtime.Dockerfile"
DEFAULT_IMAGE = f"qwen38-vllm-ple:{__version__}"
IMAGE_BUILD = f"docker build -f {IMAGE_DOCKERFILE} -t {DEFAULT_IMAGE} ."
# The container's PROMETHEUS_MULTIPROC_DIR (metrics_dir.py): a tmpfs mount, which Docker removes when the container
# stops, so every start (a restart included) begins with an empty one and no earlier run's values.
CONTAINER_METRICS_DIR = "/run/prometheus-multiproc"


def render_compose(profile: Profile, side: EngineSide, *, service: str, image: str, model_dir: str, cache_dir: str,
                   port: int | None, publish: str, require_api_key: bool, allow_unauthenticated: bool,
                   served_names: tuple[str, ...],
                   gpus: tuple[str, ...] | None = None, chat_template: str | None = None, shm_size: str = "32g",
                   extra: list[str] | tuple[str, ...] = ()) -> str:
    """Compose file of write-up 002: SYS_PTRACE (pidfd_getfd for PLE IPC), memlock -1, ipc host; never privileged."""
    if side.service != "compose" or profile.engine != side.name:
        raise ServeRefused(f"compose files are for the engines served from a container; {side.display} profile "
                           f"{profile.name} is served by `service` as a systemd unit")
    # The published address is what clients reach; the key comes from the host's environment at
    # `docker compose up` (compose interpolation), so it is never written into the file.
    check_exposure(publish, "env" if require_api_key else None, allow_unauthenticated)
    tp = int(profile.value("--tensor-parallel-size")) if profile.has("--tensor-parallel-size") else 1
    gpus = tuple(gpus) if gpus else tuple(str(i) for i in range(tp))
    if len(gpus) != tp:
        raise ServeRefused(f"profile {profile.name} runs tensor parallel {tp}; got {len(gpus)} GPU ids {list(gpus)}")
    port = port or profile.port
    extra = list(extra)
    volumes = [f"{model_dir}:/model:ro", f"{cache_dir}:/root/.cache"]
    if chat_template:
        volumes.append(f"{chat_template}:/opt/chat-template.jinja:ro")
        extra += ["--chat-template", "/opt/chat-template.jinja"]
    launch = build_launch(profile, side, model="/model", host="0.0.0.0", port=port, api_key=None,
                          served_names=served_names, allow_unauthenticated=True, extra=extra, base_env={})
    command = launch.argv[2:]  # the image's entrypoint is `vllm serve`
    env = {k: v for k, v in launch.env.items() if k in profile.env}  # placeholders filled (the model is /model)
    if launch.fresh_metrics_dir:
        env[MULTIPROC_ENV] = CONTAINER_METRICS_DIR
    if require_api_key:
        env[API_KEY_ENV] = f"${{{API_KEY_ENV}:?set {API_KEY_ENV} on the host}}"
    out = [
        *([f"# {DEFAULT_IMAGE}: this kit's vLLM runtime; build it in the kit's repository first: {IMAGE_BUILD}"]
          if image == DEFAULT_IMAGE else []),
        "services:",
        f"  {service}:",
        f"    image: {_y(image)}",
        f"    container_name: {_y(service)}",
        "    restart: unless-stopped",
        "    ports:",
        f"      - {_y(f'{publish}:{port}:{port}')}",
        "    volumes:",
        *[f"      - {_y(v)}" for v in volumes],
        *(["    tmpfs:", f"      - {_y(CONTAINER_METRICS_DIR)}"] if launch.fresh_metrics_dir else []),
        "    environment:",
        *[f"      {k}: {_y(v)}" for k, v in env.items()],
        "    cap_add:",
        "      - SYS_PTRACE",
        "    ipc: host",
        f"    shm_size: {_y(shm_size)}",
        "    ulimits:",
        "      memlock: -1",
        "      stack: 67108864",
        "    deploy:",
        "      resources:",
        "        reservations:",
        "          devices:",
        "            - driver: nvidia",
        f"              device_ids: {json.dumps(list(gpus))}",
        "              capabilities: [gpu]",
        "    command:",
        *[f"      - {_y(a)}" for a in command],
    ]
    return "\n".join(out) + "\n"


def render_watch_unit(*, name: str, server_unit: str | None, description: str, user: str, group: str | None,
                      home: str, exec_argv: list[str]) -> str:
    """The unit that runs ``watch`` beside the server: it outlives server restarts (that is when it matters),
    starts after the server, and asks the kernel to spare it under memory pressure."""
    after = f"{server_unit}.service" if server_unit else "network-online.target"
    return (
        "[Unit]\n"
        f"Description={description}\n"
        f"Wants={after}\n"
        f"After={after}\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"User={user}\n"
        f"Group={group or user}\n"
        f"WorkingDirectory={systemd_quote(home)}\n"
        f"Environment={systemd_quote(f'HOME={home}')}\n"
        f"ExecStart={' '.join(systemd_quote(a) for a in exec_argv)}\n"
        "Restart=always\n"
        "RestartSec=10\n"
        "OOMScoreAdjust=-500\n"  # the watch must outlive the pressure it records (write-up 000: no OOM record)
        "Nice=-5\n"
        "StandardOutput=journal\n"
        "StandardError=journal\n"
        f"SyslogIdentifier={name}\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )
