#include "dtrain/comm/node_groups.h"

#include <algorithm>

namespace dtrain::comm {

std::vector<std::vector<int>> members_by_node(const ProcessGroup& pg) {
  std::vector<int> order;
  std::vector<std::vector<int>> lists;
  const std::vector<int>& nodes = pg.member_nodes();
  for (int r = 0; r < pg.size(); ++r) {
    const int node = nodes.at(static_cast<size_t>(r));
    const auto at = std::find(order.begin(), order.end(), node);
    if (at == order.end()) {
      order.push_back(node);
      lists.push_back({r});
    } else {
      lists[static_cast<size_t>(at - order.begin())].push_back(r);
    }
  }
  return lists;
}

NodeGroups split_by_node(const ProcessGroup& pg) {
  const std::vector<std::vector<int>> lists = members_by_node(pg);
  if (lists.size() < 2) return {};
  const size_t per_node = lists.front().size();
  if (per_node == 1) return {};  // (one member a node: the flat collective crosses once already)
  for (const auto& l : lists) {
    if (l.size() != per_node) return {};  // (every member decides alike: the same member_nodes)
  }
  std::vector<std::vector<int>> across(per_node);
  for (size_t l = 0; l < per_node; ++l) {
    for (const auto& node : lists) across[l].push_back(node[l]);
  }
  NodeGroups g;
  g.within = pg.split(lists, pg.label() + "_within_node");
  g.across = pg.split(across, pg.label() + "_across_nodes");
  return g;
}

}  // namespace dtrain::comm
