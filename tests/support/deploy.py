"""Helpers of the deployment tests (deploy/, docker-compose.yml): where the files are, and small parsers of them.

The parsers read a Dockerfile the way ``docker build`` does for the parts these
tests check: line continuations, comment lines, exec (JSON) and shell forms,
``ENV`` with ``$VAR`` substitution, and stages split at ``FROM``
(https://docs.docker.com/reference/dockerfile/).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
COMPOSE_TLS_FILE = REPO_ROOT / "docker-compose.tls.yml"
CONFIG_FILE = REPO_ROOT / "deploy" / "config" / "kvstore.yaml"
PROMETHEUS_FILE = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"


@dataclass(frozen=True, slots=True)
class Instruction:
    """One Dockerfile instruction.

    Attributes:
        keyword: the upper-cased instruction, e.g. ``RUN``.
        value: its arguments, continuation lines joined with single spaces.
        stage: index of the build stage it belongs to (0 for the first ``FROM``; -1 before it).
        line: 1-based line number where it starts.
    """

    keyword: str
    value: str
    stage: int
    line: int


def parse_dockerfile(path: Path = DOCKERFILE) -> list[Instruction]:
    """Split a Dockerfile into instructions.

    Comment lines (also inside a continuation, as Docker drops them there) and
    blank lines are skipped; a trailing backslash continues the instruction.

    Args:
        path: the Dockerfile.

    Returns:
        The instructions in file order.

    Raises:
        ValueError: when the file ends inside a continuation.
    """
    instructions: list[Instruction] = []
    stage, buffer, start = -1, "", 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer += stripped[:-1].strip() + " "
            continue
        text = (buffer + stripped).strip()
        buffer = ""
        keyword, _, value = text.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, value.strip(), stage, start))
    if buffer:
        raise ValueError(f"{path} ends inside a line continuation")
    return instructions


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    """The instructions of the last build stage, the one the image is made of."""
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def exec_form(value: str) -> list[str]:
    """The argv of an exec-form (JSON array) ``ENTRYPOINT``/``CMD``/``VOLUME`` value.

    Raises:
        ValueError: when the value is in shell form.
    """
    try:
        argv = json.loads(value)
    except json.JSONDecodeError:
        raise ValueError(f"not in exec (JSON array) form: {value!r}") from None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"not a JSON array of strings: {value!r}")
    return argv


_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def image_env(instructions: list[Instruction], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment that the final stage's ``ENV`` instructions set.

    ``$VAR`` and ``${VAR}`` are replaced from earlier ``ENV`` values, then from
    ``base``, then by the empty string, as ``docker build`` does.

    Args:
        instructions: the whole Dockerfile (see :func:`parse_dockerfile`).
        base: the environment of the base image, e.g. ``{"PATH": "/usr/bin"}``.

    Returns:
        Only the variables that ``ENV`` sets, mapped to their final values.
    """
    env: dict[str, str] = {}
    known = dict(base or {})
    for instruction in final_stage(instructions):
        if instruction.keyword != "ENV":
            continue
        for item in shlex.split(instruction.value):
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"line {instruction.line}: use ENV NAME=value, got {item!r}")
            value = _VAR.sub(lambda m: known.get(m.group(1) or m.group(2), ""), value)
            env[name] = known[name] = value
    return env


def start_command(instructions: list[Instruction]) -> list[str]:
    """The argv a container of the image runs by default: ``ENTRYPOINT`` followed by ``CMD``.

    Raises:
        ValueError: when either is in shell form (signals would reach ``sh``, not kvstore).
    """
    entrypoint: list[str] = []
    cmd: list[str] = []
    for instruction in final_stage(instructions):
        if instruction.keyword == "ENTRYPOINT":
            entrypoint = exec_form(instruction.value)
        elif instruction.keyword == "CMD":
            cmd = exec_form(instruction.value)
    return entrypoint + cmd


def healthcheck_command(instructions: list[Instruction]) -> str:
    """The shell command of the final stage's ``HEALTHCHECK CMD`` (options stripped).

    Raises:
        ValueError: when there is no ``HEALTHCHECK CMD``.
    """
    for instruction in final_stage(instructions):
        if instruction.keyword == "HEALTHCHECK":
            _, sep, command = instruction.value.partition("CMD ")
            if sep:
                return command.strip()
    raise ValueError("no HEALTHCHECK CMD in the final stage")


def load_yaml_documents(path: Path) -> Iterator[object]:
    """Every YAML document of ``path``, empty ones skipped, parsed by ``yaml.safe_load_all``."""
    with path.open() as stream:
        yield from (doc for doc in yaml.safe_load_all(stream) if doc is not None)
