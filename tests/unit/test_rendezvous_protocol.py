"""The agents' handler seam: what they call on it is declared in one Protocol, which the etcd3
handler implements, and they probe nothing with getattr/hasattr."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import elastictrain.launch.agent as agent_module
import elastictrain.launch.inprocess_agent as inprocess_module
from elastictrain.rendezvous.handler import Etcd3RendezvousHandler
from elastictrain.rendezvous.protocol import AgentRendezvousHandler

AGENTS = [Path(agent_module.__file__), Path(inprocess_module.__file__)]


def _declared() -> set[str]:
    names = {n for n in vars(AgentRendezvousHandler) if not n.startswith("_")}
    return names | set(AgentRendezvousHandler.__annotations__)


def _called_on_the_handler(path: Path) -> set[str]:
    """Attributes the module reads on ``agent_handler(...)`` or on a name ``handler`` bound to it."""
    tree = ast.parse(path.read_text())
    used = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "handler") or (
                isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "agent_handler"):
            used.add(node.attr)
    return used


def test_the_etcd3_handler_provides_every_extra_the_agents_call() -> None:
    init = inspect.getsource(Etcd3RendezvousHandler.__init__)
    missing = [name for name in _declared()
               if not hasattr(Etcd3RendezvousHandler, name) and f"self.{name} =" not in init]
    assert not missing, missing


def test_what_the_agents_call_on_their_handler_is_declared_in_the_protocol() -> None:
    for path in AGENTS:
        undeclared = _called_on_the_handler(path) - _declared()
        assert not undeclared, f"{path.name} calls {sorted(undeclared)} on its handler, undeclared"


def test_the_agents_probe_their_handler_with_no_getattr() -> None:
    for path in AGENTS:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in {"getattr", "hasattr"} and "handler" in ast.unparse(node.args[0])):
                raise AssertionError(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
