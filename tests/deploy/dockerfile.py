"""A small Dockerfile reader for tests: instructions per stage, and the image's command.

Only what the tests need: line continuations, comments, parser directives, exec (JSON) and shell
forms. It is not a full Dockerfile parser (no heredocs, no escape directive).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    arguments: str  # the raw text after the keyword, continuations joined
    line: int  # 1-based line where it starts


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def read_instructions(path: Path) -> list[Instruction]:
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        text = " ".join(part for part in pending if part)
        keyword, _, arguments = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), arguments.strip(), start))
        pending = []
    if pending:
        raise ValueError(f"{path}: the instruction starting on line {start} ends with a dangling backslash")
    return instructions


def read_stages(path: Path) -> list[Stage]:
    stages: list[Stage] = []
    for instruction in read_instructions(path):
        if instruction.keyword == "FROM":
            words = instruction.arguments.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif stages:
            stages[-1].instructions.append(instruction)
    if not stages:
        raise ValueError(f"{path} has no FROM instruction")
    return stages


def exec_form(instruction: Instruction) -> list[str]:
    """ENTRYPOINT/CMD arguments as the argv list Docker would run."""
    text = instruction.arguments
    if text.startswith("["):
        argv = json.loads(text)
        if not all(isinstance(word, str) for word in argv):
            raise ValueError(f"line {instruction.line}: exec form must be a JSON list of strings")
        return argv
    return ["/bin/sh", "-c", text]


def image_command(path: Path) -> list[str]:
    """ENTRYPOINT + CMD of the final stage: the command `docker run <image>` starts."""
    final = read_stages(path)[-1]
    entrypoint = final.all("ENTRYPOINT")
    cmd = final.all("CMD")
    argv = exec_form(entrypoint[-1]) if entrypoint else []
    return argv + (exec_form(cmd[-1]) if cmd else [])


def image_env(path: Path) -> dict[str, str]:
    """ENV of the final stage (KEY=VALUE form), with $VAR references left unexpanded."""
    env: dict[str, str] = {}
    for instruction in read_stages(path)[-1].all("ENV"):
        for word in shlex.split(instruction.arguments):
            key, sep, value = word.partition("=")
            if not sep:
                raise ValueError(f"line {instruction.line}: use the ENV KEY=VALUE form")
            env[key] = value
    return env
