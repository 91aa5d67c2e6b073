"""What elastictrain's node agents call on their rendezvous handler beyond torch's interface.

torch's agent knows a handler as a ``RendezvousHandler`` (``next_rendezvous``,
``num_nodes_waiting``, ...). The agents of ``elastictrain run`` (:mod:`elastictrain.launch.agent`,
:mod:`elastictrain.launch.inprocess_agent`) also follow the round a node joined, hold a round
for joining nodes, say when their workers are ready and leave a round they are cut off from.
:class:`AgentRendezvousHandler` declares all of it in one place; the agents type their handler
against it. :class:`~elastictrain.rendezvous.handler.Etcd3RendezvousHandler` is the one
implementation (checked by mypy below).

The agents need no other handler: ``elastictrain run`` always gives them an
``Etcd3RendezvousHandler`` (``launch.launcher``), and torchrun's ``--rdzv-backend etcd3`` runs the
handler under torch's own agent, which calls only torch's interface. :func:`agent_handler` is a
cast, not a run-time check: on Python 3.11 ``isinstance`` against a protocol evaluates every
property, and these take the handler's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from elastictrain._fault import Fault
    from elastictrain.rendezvous.handler import Etcd3RendezvousHandler
    from elastictrain.rendezvous.records import RoundRecord

__all__ = ["AgentRendezvousHandler", "agent_handler"]


class AgentRendezvousHandler(Protocol):
    """A rendezvous handler as elastictrain's agents use it: torch's interface (the methods the
    agents call themselves) and the extras. Errors: the methods that read or write etcd raise
    :class:`~elastictrain.errors.EtcdError` when etcd is unreachable or refuses."""

    node_id: str
    """This node's id in the rendezvous."""

    # --- torch's RendezvousHandler, as the agents call it ---------------------------------------

    def get_run_id(self) -> str: ...

    @property
    def use_agent_store(self) -> bool: ...

    def num_nodes_waiting(self) -> int:
        """Every reason to re-form this node's round (no etcd request)."""
        ...

    # --- the round this node is in --------------------------------------------------------------

    @property
    def round(self) -> int | None:
        """The round this node last joined (``None`` before its first)."""
        ...

    @property
    def joined(self) -> RoundRecord | None:
        """The round record this node last joined."""
        ...

    @property
    def closed_seen(self) -> bool:
        """Whether this node has seen the rendezvous closed (no etcd request)."""
        ...

    @property
    def finished_seen(self) -> bool:
        """Whether this node has seen it closed because a node finished training."""
        ...

    def wake_on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on a watch thread; it must not block) whenever
        :meth:`num_nodes_waiting` or :meth:`ready_nodes` may have changed."""
        ...

    def set_finished(self) -> None:
        """Close the rendezvous: this node's workers finished training, the job is done."""
        ...

    # --- a node that joins while the others train -----------------------------------------------

    def only_nodes_joining(self) -> bool:
        """Whether :meth:`num_nodes_waiting` counts only nodes that wait to join (no etcd request)."""
        ...

    def reenter_for_joiners(self) -> None:
        """Say that this node's next ``next_rendezvous`` only takes in nodes that wait to join."""
        ...

    def say_ready(self) -> None:
        """Say, in etcd, that this node's workers can form the group of the round it joined."""
        ...

    def ready_nodes(self) -> int:
        """How many nodes of the round this node joined said their workers are ready."""
        ...

    # --- the cause of a re-formation -------------------------------------------------------------

    def say_fault(self, rank: int, how: str) -> None:
        """Say, in this node's next request for a round, that its worker of global ``rank`` failed, and how."""
        ...

    def seen_faults(self) -> list[Fault]:
        """The faults the other members of this node's round said or were seen to meet (no etcd request)."""
        ...

    def round_faults(self) -> list[Fault]:
        """The worker failures members of the round just formed said as they asked for it."""
        ...

    # --- a node cut off from its peers ----------------------------------------------------------

    def peers_reached(self) -> dict[str, bool]:
        """Whether this node reaches each other member of its round (a probe each)."""
        ...

    def withdraw(self) -> None:
        """Leave the round (this node cannot reach its peers); rejoin once it reaches them."""
        ...


def agent_handler(handler: Any) -> AgentRendezvousHandler:
    """``handler`` (a ``WorkerSpec.rdzv_handler``, typed by torch as its base interface) as the
    agents use it. A cast: see the module docstring for why the agents get no other handler."""
    return cast(AgentRendezvousHandler, handler)


if TYPE_CHECKING:
    def _implements(handler: Etcd3RendezvousHandler) -> AgentRendezvousHandler:
        return handler  # mypy checks here that the etcd3 handler provides everything above
