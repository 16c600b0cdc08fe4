#pragma once
// A group split by node (ProcessGroup::member_nodes), for collectives in two levels: inside each
// node first, then across nodes once (comm/quantized.h's two-level reduce-scatter).
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain::comm {

// `within`: the members on this rank's node (in group order); `across`: the members with this
// rank's local index on every node (nodes in the order they first appear in the group). Both
// empty where the group is on one node, has one member a node, or its nodes hold different
// numbers of its members.
struct NodeGroups {
  ProcessGroup within, across;
  bool two_level() const { return within.is_member() && across.is_member(); }
};

// Collective over `pg` (two splits, labelled "<label>_within_node" and "<label>_across_nodes"):
// every member calls it.
NodeGroups split_by_node(const ProcessGroup& pg);

// The group's members by node: one list of group ranks per node, nodes in order of first appearance.
std::vector<std::vector<int>> members_by_node(const ProcessGroup& pg);

}  // namespace dtrain::comm
