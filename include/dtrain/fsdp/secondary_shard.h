#pragma once
// FSDP's secondary shard (DeepSpeed ZeRO++'s hpZ): `--secondary-shard node`.
//
// Design note [secondary shards]
// ------------------------------
// FullShard gathers each unit's parameters twice a step, for its forward and again for its
// backward, both over the whole shard group: where that group spans nodes, 2 of FSDP's 3 parameter
// volumes a step cross the slow link. With a secondary shard, a unit that frees its parameters after
// its forward first keeps this rank's part of them over its node's ranks (1 / L of the unit for L
// ranks a node, the part at its index in the node: FlatParam::State::NodeSharded), and the
// backward's gather is an all-gather of those parts inside the node: across nodes only the
// forward's gather and the gradients' reduce-scatter remain (3 volumes -> 2, ZeRO++'s figure).
//   - The parts are copies of the values the forward computed with (quantized ones too, under
//     --gather-quant), gathered exactly (in the compute dtype): the backward sees the same
//     parameters as without, so training is bit-identical; only the bytes move elsewhere.
//   - They are dropped when the unit's backward ends, and at every reset of an iteration (a forward
//     without backward, a second forward before backward): a copy never outlives the step it was
//     made in, so an optimizer step can never be undone by one.
//   - It costs 1 / L of each resharded unit's gathered bytes from its forward to its backward
//     (ZeRO++ keeps the same); the memory planner counts it (train/planner_count.cpp).
//   - It applies where the shard group spans several nodes with the same number (> 1) of its
//     ranks on each (comm::split_by_node, comm/node_groups.h) and units are resharded after
//     forward (FullShard, HybridShard's shard groups); elsewhere it changes nothing (one node: the
//     gather is already inside it).
#include <string>

namespace dtrain::fsdp {

enum class SecondaryShard {
  None,
  Node,  // a copy of each resharded unit's parameters over the node's ranks, for the backward's gather
};

const char* to_string(SecondaryShard s);  // "none", "node"
// "none" | "node" (--secondary-shard); throws naming the value.
SecondaryShard parse_secondary_shard(const std::string& text);

}  // namespace dtrain::fsdp
