"""Where an attempt's workers meet: the per-attempt rendezvous store, and the job across nodes.

  Rendezvous (api.py): the interface the job drives, one backend per topology —
    SingleNode (single.py): a fresh loopback store per attempt
    MultiNode (multi.py): joins the job through this node's agent (job_link.py ->
      node_agent_main.py, a helper process), global ranks, cross-node root causes
  HostedStore, StoreServer (store.py -> store_main.py, a helper process kept warm across
    attempts): each attempt's torch TCPStore, on a socket the supervisor bound first
  NodeSpec, bind_master, NodeLinkError (nodes.py): multi-node addresses and errors;
    training_fingerprint: what must match between nodes (and between runs sharing learned timeouts)
  read_slurm (slurm_env.py): this node's place in a SLURM allocation
"""

from supervisor.rendezvous.api import OnCause, Rendezvous, Setup
from supervisor.rendezvous.multi import MultiNode
from supervisor.rendezvous.nodes import DEFAULT_PORT, NodeLinkError, NodeSpec, bind_master, training_fingerprint
from supervisor.rendezvous.single import SingleNode
from supervisor.rendezvous.slurm_env import SlurmError, read_slurm
from supervisor.rendezvous.store import HostedStore, StoreServer

__all__ = [
    "DEFAULT_PORT", "HostedStore", "MultiNode", "NodeLinkError", "NodeSpec", "OnCause", "Rendezvous", "Setup",
    "SingleNode", "SlurmError", "StoreServer", "bind_master", "read_slurm", "training_fingerprint",
]
