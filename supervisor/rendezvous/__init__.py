"""Where an attempt's workers meet: the per-attempt rendezvous store, and the job across nodes.

  Rendezvous (api.py): the interface the job drives, one backend per topology —
    SingleNode, SingleStore (single.py): a fresh store per attempt, where torchrun's flags put it
    MultiNode (multi.py): joins the job through this node's agent (job_link.py ->
      node_agent_main.py, a helper process), global ranks, cross-node root causes
    ElasticRounds (elastic_rounds.py, inside the agent; elastic_join.py, the agent's join through
      it): --nnodes MIN:MAX, who node 0 admits to each round, and a late node's wait for the next one
    fixed_join.py, agent_end.py (inside the agent): a fixed-size round's join; node 0's end of an
      attempt and of the job (the done wait, every node's outcome, the linger)
    agent_causes.py: every root cause the agent writes or emits, built from what it is given
    RegroupLink (regroup_link.py -> regroup_agent.py, inside the agent): a live recovery's rebuilt
      group, claimed by the node that lost a rank and heard of by every other node
    spare_node_agent.py, node_shrink_agent.py (inside node 0's agent): a node that died whole, its
      place handed to a spare node (--spare-nodes) or, with none free, the job shrunk without it;
      they get a frozen Roster (roster.py), never the agent, and return what the agent applies
  HostedStore, StoreServer (store.py -> store_main.py, a helper process kept warm across
    attempts): each attempt's torch TCPStore, on a socket the supervisor bound first
  LiveClaim, decode_claim (live_claim.py): a live recovery's claim of a rebuilt group, decoded once
  NodeSpec, bind_master, NodeLinkError (nodes.py): multi-node addresses and errors;
    training_fingerprint: what must match between nodes (and between runs sharing learned timeouts)
  read_slurm, kill_wait, slurm_stop, requeue_after_preemption (slurm_env.py): this node's place in
    a SLURM allocation; SLURM's KillWait; why SLURM stopped the job; requeueing a preempted job
"""

from supervisor.rendezvous.api import OnCause, Rendezvous, Setup
from supervisor.rendezvous.live_claim import LiveClaim, decode_claim
from supervisor.rendezvous.multi import MultiNode
from supervisor.rendezvous.nodes import (DEFAULT_PORT, NodeLinkError, NodeSpec, SpareNodeUnused, bind_master,
                                        training_fingerprint)
from supervisor.rendezvous.single import SingleNode, SingleStore
from supervisor.rendezvous.slurm_env import (
    SLURM_STOP,
    SlurmError,
    SlurmStop,
    job_info,
    kill_wait,
    read_slurm,
    requeue_after_preemption,
    slurm_stop,
)
from supervisor.rendezvous.store import HostedStore, StoreServer

__all__ = [
    "DEFAULT_PORT", "SLURM_STOP", "HostedStore", "MultiNode", "NodeLinkError", "NodeSpec", "SpareNodeUnused", "OnCause", "Rendezvous", "Setup",
    "LiveClaim", "decode_claim",
    "SingleNode", "SingleStore", "SlurmError", "StoreServer", "bind_master", "job_info", "kill_wait", "read_slurm",
    "SlurmStop", "requeue_after_preemption", "slurm_stop", "training_fingerprint",
]
