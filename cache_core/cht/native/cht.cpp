// The Chunked Hash Tree as a path-compressed trie of digest chains (module cache_core.cht._native).
//
// The Python class cache_core.cht.tree.ChunkedHashTree derives from NativeTree; its docstring states
// the semantics. This file states the representation and its invariants.
//
// Representation. Every request, waiting or running, is the chain of its chunk digests. The trie
// holds the multiset of chains, path-compressed: a node is a maximal run of depths [lo, hi] along
// which the same requests pass, so it splits exactly where chains branch or end. A chained digest
// names its whole prefix, so a node is found by its first digest (`starts_`), and a chain matches a
// node's run up to the deepest depth whose digests are equal (binary search on one run).
//
// Per node: wc/rc, the waiting/running requests through it; ends, the requests ending at hi;
// slot_xor, the xor of the slots of its waiting requests (its one waiting request when wc == 1).
//
// Invariants (checked through the Python tests against the pure-Python CHT and the token trie):
//  1. Canonical: every node but the root has >= 2 children or ends > 0; a node with no request
//     through it does not exist. So the trie is a function of the multiset of chains.
//  2. A waiting request's group is the deepest node on its path with wc >= 2 (none: a group of its
//     own). `members` of a node holds the (key, slot) of the requests whose group it is.
//  3. `gset` of the root, and of every node with wc >= 2, holds one entry per group in its subtree
//     (every group, singletons included, for the root): the group's best member (smallest key).
//  4. The frontier F is the root and every node with rc > 0. `global_` holds one entry per F node
//     with wc > 0: its best waiting request (gset's first, or its one request) with the selection
//     value through it, (n - hi, -hi, seq). A request's value through the deepest F node on its
//     path is its selection key; through shallower ones it is larger.
//  5. Every container is empty once every request has left (memory_entries()).
//
// Costs: an operation on one request walks its path (L nodes) with O(log W) set updates per node;
// adding also binary-searches each run it passes. L is the number of branch points on the path,
// not its chunk count.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <queue>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kSeqBits = 40;
constexpr uint64_t kSeqMask = (uint64_t{1} << kSeqBits) - 1;
constexpr size_t kMaxChunks = size_t{1} << 22;
constexpr uint32_t kRoot = 0;
constexpr uint32_t kNone = UINT32_MAX;
constexpr uint32_t kSingle = UINT32_MAX;  // group of a request that shares no chunk with another waiting one

inline uint64_t make_key(uint32_t n, uint64_t seq) { return (uint64_t{n} << kSeqBits) | seq; }
inline uint32_t key_n(uint64_t key) { return static_cast<uint32_t>(key >> kSeqBits); }
inline uint64_t key_seq(uint64_t key) { return key & kSeqMask; }

// A group's best member, as held in gset (ordered by key; keys are unique per request).
struct GroupEntry {
  uint64_t key;
  uint32_t slot;
  uint32_t group;
  bool operator<(const GroupEntry& o) const { return key < o.key; }
};

// A selection value through a node: (missing, -depth, seq) ascending.
struct Value {
  uint64_t missing;
  uint32_t depth;
  uint64_t seq;
  bool operator<(const Value& o) const {
    if (missing != o.missing) return missing < o.missing;
    if (depth != o.depth) return depth > o.depth;
    return seq < o.seq;
  }
  bool operator==(const Value& o) const { return missing == o.missing && depth == o.depth && seq == o.seq; }
};

struct FrontierEntry {
  Value value;
  uint32_t node;
  uint32_t slot;
  bool operator<(const FrontierEntry& o) const { return value < o.value; }
};

struct Node {
  uint32_t parent = kNone;
  uint32_t lo = 1, hi = 0;            // depths covered; the root covers none
  std::vector<uint64_t> digests;      // hi - lo + 1 of them
  std::vector<uint32_t> children;
  uint32_t child_pos = 0;             // position in the parent's children
  uint32_t wc = 0, rc = 0, ends = 0;
  uint64_t slot_xor = 0;
  std::set<std::pair<uint64_t, uint32_t>> members;
  std::set<GroupEntry> gset;
  bool has_entry = false;
  FrontierEntry entry{};
  bool live = false;
};

enum class State : uint8_t { kFree, kWaiting, kRunning };

struct Request {
  py::object id;
  uint64_t seq = 0;
  uint32_t n = 0;
  uint32_t end = kRoot;
  State state = State::kFree;
  int64_t prev = -1, next = -1;       // arrival order while waiting, activation order while running
};

struct OrderList {
  int64_t head = -1, tail = -1;
  size_t size = 0;
};

class NativeTree {
 public:
  NativeTree() { nodes_.emplace_back(); nodes_[kRoot].live = true; }

  void assign(const NativeTree& other) {
    nodes_ = other.nodes_;
    free_nodes_ = other.free_nodes_;
    requests_ = other.requests_;
    free_slots_ = other.free_slots_;
    ids_ = py::reinterpret_steal<py::dict>(PyDict_Copy(other.ids_.ptr()));   // ids shared, the map copied
    starts_ = other.starts_;
    global_ = other.global_;
    shared_nodes_ = other.shared_nodes_;
    waiting_ = other.waiting_;
    running_ = other.running_;
    next_seq_ = other.next_seq_;
    num_prefixes_ = other.num_prefixes_;
    common_valid_ = other.common_valid_;
    common_ = other.common_;
  }

  size_t num_waiting() const { return waiting_.size; }
  size_t num_running() const { return running_.size; }
  size_t num_prefixes() const { return num_prefixes_; }
  bool is_waiting(const py::object& id) const { return state_of(id) == State::kWaiting; }
  bool is_running(const py::object& id) const { return state_of(id) == State::kRunning; }
  py::list waiting_ids() const { return ids_in(waiting_); }
  py::list running_ids() const { return ids_in(running_); }

  // ----------------------------------------------------------------------------------- mutations
  void add(const py::object& id, const py::array& digests_in) {
    check_new(id);
    if (digests_in.ndim() != 1 || (digests_in.dtype().kind() != 'u' && digests_in.dtype().kind() != 'i')) {
      throw std::invalid_argument("request " + repr(id) + ": digests must be a 1-D integer array");
    }
    auto digests = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(digests_in);
    add_chain(id, digests.data(), static_cast<size_t>(digests.size()));
  }

  // add() with the digests of traces.chunk_hash.block_hash_digests(block_hashes, 1, step) for
  // bytes hashes (vLLM's request.block_hashes): the first 8 bytes, little endian, of every
  // step-th hash, read without building an array.
  void add_block_hashes(const py::object& id, const py::sequence& block_hashes, size_t step) {
    check_new(id);
    if (step < 1) throw std::invalid_argument("step must be >= 1, got " + std::to_string(step));
    const size_t count = static_cast<size_t>(py::len(block_hashes));
    std::vector<uint64_t> chain;
    chain.reserve(count / step);
    for (size_t j = step - 1; j < count; j += step) {
      py::object hash = block_hashes[j];
      if (!PyBytes_Check(hash.ptr()) || PyBytes_GET_SIZE(hash.ptr()) < 8) {
        throw std::invalid_argument("request " + repr(id) + ": block hash " + std::to_string(j) +
                                    " is not bytes of at least 8 bytes");
      }
      const auto* bytes = reinterpret_cast<const unsigned char*>(PyBytes_AS_STRING(hash.ptr()));
      uint64_t digest = 0;
      for (int b = 7; b >= 0; --b) digest = (digest << 8) | bytes[b];
      chain.push_back(digest);
    }
    add_chain(id, chain.data(), chain.size());
  }

 private:
  void check_new(const py::object& id) const {
    if (ids_.contains(id)) {
      throw std::invalid_argument("request " + repr(id) + " is already " +
                                  (state_of(id) == State::kWaiting ? "waiting" : "running"));
    }
  }

  void add_chain(const py::object& id, const uint64_t* chain, size_t n) {
    if (n >= kMaxChunks) {
      throw std::invalid_argument("request " + repr(id) + ": " + std::to_string(n) + " chunks, at most " +
                                  std::to_string(kMaxChunks - 1));
    }
    // Locate, without changing anything: the node the chain leaves the trie from, and a split.
    uint32_t at = kRoot, split = kNone, depth = 0;
    while (depth < n) {
      auto found = starts_.find(chain[depth]);
      if (found == starts_.end()) break;
      const uint32_t child = found->second;
      const Node& c = nodes_[child];
      if (c.parent != at || c.lo != depth + 1) {
        throw std::invalid_argument("request " + repr(id) + ": digest " + std::to_string(chain[depth]) +
                                    " at depth " + std::to_string(depth + 1) + " is stored at depth " +
                                    std::to_string(c.lo) + "; digests must be chained");
      }
      uint32_t matched = c.lo, top = std::min<uint32_t>(c.hi, static_cast<uint32_t>(n));
      while (matched < top) {            // chained: equal at a depth means equal above it
        const uint32_t mid = (matched + top + 1) >> 1;
        if (chain[mid - 1] == c.digests[mid - c.lo]) matched = mid; else top = mid - 1;
      }
      at = child;
      depth = matched;
      if (matched < c.hi) { split = child; break; }
    }

    if (split != kNone) at = split_node(split, depth);
    uint32_t end = at;
    if (depth < n) {
      end = new_node(at, depth + 1, static_cast<uint32_t>(n), chain + depth);
    }
    const uint32_t slot = new_request(id, static_cast<uint32_t>(n), end);
    nodes_[end].ends += 1;
    link(waiting_, slot);
    join_waiting(slot);
  }

 public:
  void remove(const py::object& id) {
    const uint32_t slot = take(id, State::kWaiting, "remove");
    leave_waiting(slot);
    unlink(waiting_, slot);
    drop_request(slot);
  }

  void activate(const py::object& id) {
    const uint32_t slot = take(id, State::kWaiting, "activate");
    leave_waiting(slot);
    unlink(waiting_, slot);
    Request& r = requests_[slot];
    r.state = State::kRunning;
    link(running_, slot);
    for (uint32_t v = r.end; v != kNone; v = nodes_[v].parent) {
      nodes_[v].rc += 1;
      refresh_entry(v);
    }
    common_valid_ = false;
  }

  void finish(const py::object& id) {
    const uint32_t slot = take(id, State::kRunning, "finish");
    unlink(running_, slot);
    for (uint32_t v = requests_[slot].end; v != kNone; v = nodes_[v].parent) {
      nodes_[v].rc -= 1;
      refresh_entry(v);
    }
    common_valid_ = false;
    drop_request(slot);
  }

  // ----------------------------------------------------------------------------------- queries
  py::object find_best() const {
    if (global_.empty()) return py::none();
    return requests_[global_.begin()->slot].id;
  }

  py::list top_candidates(long k) const {
    if (k < 1) throw std::invalid_argument("top_candidates needs k >= 1, got " + std::to_string(k));
    py::list out;
    if (global_.empty()) return out;
    if (k == 1) {
      out.append(find_best());
      return out;
    }
    // A lazy merge of the frontier's streams: a gset stream yields each group of the node's subtree
    // at its best member's value through the node; a node with one waiting request yields that one.
    // Each group first appears at its best member's selection key (invariant 4).
    struct Cursor {
      Value value;
      uint32_t node;
      std::set<GroupEntry>::const_iterator it;
      bool single;
      bool operator>(const Cursor& o) const { return o.value < value; }
    };
    std::priority_queue<Cursor, std::vector<Cursor>, std::greater<Cursor>> merge;
    std::vector<uint64_t> taken;
    auto next_global = global_.begin();
    while (static_cast<long>(out.size()) < k) {
      if (next_global != global_.end() && (merge.empty() || next_global->value < merge.top().value)) {
        const uint32_t v = next_global->node;
        ++next_global;
        const Node& x = nodes_[v];
        if (has_gset(v)) {
          merge.push({value_through(x.gset.begin()->key, x.hi), v, x.gset.begin(), false});
        } else {
          merge.push({value_through(key_of(static_cast<uint32_t>(x.slot_xor)), x.hi), v, {}, true});
        }
        continue;
      }
      if (merge.empty()) break;
      Cursor cur = merge.top();
      merge.pop();
      uint32_t slot;
      uint64_t group;
      const Node& x = nodes_[cur.node];
      if (cur.single) {
        slot = static_cast<uint32_t>(x.slot_xor);
        group = group_id(group_of(slot), slot);
      } else {
        slot = cur.it->slot;
        group = group_id(cur.it->group, slot);
        auto following = std::next(cur.it);
        if (following != x.gset.end()) merge.push({value_through(following->key, x.hi), cur.node, following, false});
      }
      if (std::find(taken.begin(), taken.end(), group) == taken.end()) {
        taken.push_back(group);
        out.append(requests_[slot].id);
      }
    }
    return out;
  }

  uint32_t running_common_prefix() {
    if (!common_valid_) {
      common_ = 0;
      if (running_.size) {
        for (uint32_t v = requests_[running_.head].end; v != kRoot; v = nodes_[v].parent) {
          if (nodes_[v].rc == running_.size) { common_ = nodes_[v].hi; break; }
        }
      }
      common_valid_ = true;
    }
    return common_;
  }

  uint32_t shared_chunks(const py::object& id) const {
    const uint32_t slot = slot_of(id);
    if (slot == kNone) throw std::invalid_argument("unknown request " + repr(id));
    return shared_of(requests_[slot].end);
  }

  // (shared_chunks, missing_chunks, chunk_loss, same_prefix_waiting, num_chunks) of a waiting request.
  std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t> candidate_stats(const py::object& id) {
    const uint32_t slot = slot_of(id);
    if (slot == kNone || requests_[slot].state != State::kWaiting) {
      throw std::invalid_argument("no stats for request " + repr(id) + ": " + state_text(id));
    }
    return stats_of(slot);
  }

  // candidate_stats of each id, as rows of an int64 array [len(ids), 5].
  py::array_t<int64_t> candidate_rows(const py::sequence& ids) {
    const size_t count = static_cast<size_t>(py::len(ids));
    py::array_t<int64_t> rows({count, size_t{5}});
    auto out = rows.mutable_unchecked<2>();
    for (size_t i = 0; i < count; ++i) {
      py::object id = ids[i];
      const uint32_t slot = slot_of(id);
      if (slot == kNone || requests_[slot].state != State::kWaiting) {
        throw std::invalid_argument("no stats for request " + repr(id) + ": " + state_text(id));
      }
      auto [shared, missing, loss, same, n] = stats_of(slot);
      out(i, 0) = shared; out(i, 1) = missing; out(i, 2) = loss; out(i, 3) = same; out(i, 4) = n;
    }
    return rows;
  }

  // (depth, size) of the k largest groups in the sense of ChunkedHashTree.largest_groups.
  std::vector<std::pair<uint32_t, uint32_t>> largest_groups(long k) const {
    if (k < 0) throw std::invalid_argument("largest_groups needs k >= 0, got " + std::to_string(k));
    std::vector<std::pair<uint32_t, uint32_t>> ranked;     // (size, depth)
    for (uint32_t v : shared_nodes_) {
      const Node& x = nodes_[v];
      bool covered = false;
      for (uint32_t c : x.children) covered = covered || nodes_[c].wc == x.wc;
      if (!covered) ranked.emplace_back(x.wc, x.hi);
    }
    std::sort(ranked.begin(), ranked.end(), std::greater<>());
    if (static_cast<long>(ranked.size()) > k) ranked.resize(static_cast<size_t>(k));
    std::vector<std::pair<uint32_t, uint32_t>> out;
    for (auto [size, depth] : ranked) out.emplace_back(depth, size);
    return out;
  }

  // ----------------------------------------------------------------------------------- introspection
  // The pure-Python CHT's snapshot() format: equal content means equal trees.
  py::dict snapshot() const {
    std::vector<py::list> live(nodes_.size());
    for (int64_t s = waiting_.head; s != -1; s = requests_[s].next) {
      for (uint32_t v = requests_[s].end; v != kNone; v = nodes_[v].parent) {
        if (!live[v]) live[v] = py::list();
        live[v].append(requests_[s].id);
      }
    }
    auto frozen = [&](uint32_t v) {
      return live[v] ? py::frozenset(live[v]) : py::frozenset(py::list());
    };
    py::dict index, working_set;
    py::set shared;
    for (uint32_t v = 1; v < nodes_.size(); ++v) {
      const Node& x = nodes_[v];
      if (!x.live) continue;
      for (uint32_t depth = x.lo; depth <= x.hi; ++depth) {
        py::int_ digest(x.digests[depth - x.lo]);
        if (x.wc) {
          py::object parent = py::none();
          if (depth > x.lo) parent = py::int_(x.digests[depth - 1 - x.lo]);
          else if (x.parent != kRoot) parent = py::int_(nodes_[x.parent].digests.back());
          index[digest] = py::make_tuple(depth, parent, x.wc, frozen(v));
        }
        if (x.rc) working_set[digest] = x.rc;
        if (x.wc >= 2) shared.add(digest);
      }
    }
    py::set running;
    for (int64_t s = running_.head; s != -1; s = requests_[s].next) running.add(requests_[s].id);
    py::dict out;
    out["waiting"] = waiting_ids();
    out["running"] = running;
    out["root"] = py::make_tuple(nodes_[kRoot].wc, frozen(kRoot));
    out["index"] = index;
    out["working_set"] = working_set;
    out["shared_prefixes"] = shared;
    return out;
  }

  py::dict memory_entries() const {
    size_t nodes = 0, digests = 0, members = 0, groups = 0;
    for (uint32_t v = 0; v < nodes_.size(); ++v) {
      const Node& x = nodes_[v];
      if (!x.live) continue;
      nodes += v != kRoot;
      digests += x.digests.size();
      members += x.members.size();
      groups += x.gset.size();
    }
    py::dict out;
    out["requests"] = requests_.size() - free_slots_.size() + py::len(ids_);
    out["nodes"] = nodes;
    out["digests"] = digests;
    out["starts"] = starts_.size();
    out["group_members"] = members;
    out["group_entries"] = groups;
    out["frontier_entries"] = global_.size();
    out["shared_nodes"] = shared_nodes_.size();
    return out;
  }

 private:
  std::vector<Node> nodes_;
  std::vector<uint32_t> free_nodes_;
  std::vector<Request> requests_;
  std::vector<uint32_t> free_slots_;
  py::dict ids_;                                  // request id -> slot
  std::unordered_map<uint64_t, uint32_t> starts_; // first digest of a node -> node
  std::set<FrontierEntry> global_;
  std::set<uint32_t> shared_nodes_;               // nodes with wc >= 2
  OrderList waiting_, running_;
  uint64_t next_seq_ = 0;
  size_t num_prefixes_ = 0;
  bool common_valid_ = true;
  uint32_t common_ = 0;

  static std::string repr(const py::handle& id) { return py::repr(id).cast<std::string>(); }

  uint32_t slot_of(const py::handle& id) const {
    PyObject* found = PyDict_GetItemWithError(ids_.ptr(), id.ptr());
    if (found == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return kNone;
    }
    return static_cast<uint32_t>(PyLong_AsUnsignedLong(found));
  }

  State state_of(const py::handle& id) const {
    const uint32_t slot = slot_of(id);
    return slot == kNone ? State::kFree : requests_[slot].state;
  }

  std::string state_text(const py::handle& id) const {
    switch (state_of(id)) {
      case State::kWaiting: return "it is waiting";
      case State::kRunning: return "it is running";
      default: return "unknown request id";
    }
  }

  uint32_t take(const py::object& id, State wanted, const char* action) const {
    const uint32_t slot = slot_of(id);
    if (slot == kNone || requests_[slot].state != wanted) {
      throw std::invalid_argument(std::string("cannot ") + action + " request " + repr(id) + ": " + state_text(id));
    }
    return slot;
  }

  py::list ids_in(const OrderList& list) const {
    py::list out;
    for (int64_t s = list.head; s != -1; s = requests_[s].next) out.append(requests_[s].id);
    return out;
  }

  void link(OrderList& list, uint32_t slot) {
    Request& r = requests_[slot];
    r.prev = list.tail;
    r.next = -1;
    if (list.tail != -1) requests_[list.tail].next = slot; else list.head = slot;
    list.tail = slot;
    list.size += 1;
  }

  void unlink(OrderList& list, uint32_t slot) {
    Request& r = requests_[slot];
    if (r.prev != -1) requests_[r.prev].next = r.next; else list.head = r.next;
    if (r.next != -1) requests_[r.next].prev = r.prev; else list.tail = r.prev;
    r.prev = r.next = -1;
    list.size -= 1;
  }

  uint32_t new_request(const py::object& id, uint32_t n, uint32_t end) {
    uint32_t slot;
    if (!free_slots_.empty()) { slot = free_slots_.back(); free_slots_.pop_back(); }
    else { slot = static_cast<uint32_t>(requests_.size()); requests_.emplace_back(); }
    Request& r = requests_[slot];
    r.id = id;
    r.seq = next_seq_++;
    r.n = n;
    r.end = end;
    r.state = State::kWaiting;
    ids_[id] = py::int_(slot);
    return slot;
  }

  // A request left the trie (finished or removed): free its slot, then the nodes only it held.
  void drop_request(uint32_t slot) {
    Request& r = requests_[slot];
    uint32_t v = r.end;
    PyDict_DelItem(ids_.ptr(), r.id.ptr());
    r.id = py::object();
    r.state = State::kFree;
    free_slots_.push_back(slot);
    nodes_[v].ends -= 1;
    while (v != kRoot && nodes_[v].wc == 0 && nodes_[v].rc == 0) {
      const uint32_t parent = nodes_[v].parent;
      delete_node(v);
      v = parent;
    }
    if (v != kRoot && nodes_[v].ends == 0 && nodes_[v].children.size() == 1) merge_into_child(v);
  }

  uint64_t key_of(uint32_t slot) const { return make_key(requests_[slot].n, requests_[slot].seq); }

  static Value value_through(uint64_t key, uint32_t depth) { return {key_n(key) - depth, depth, key_seq(key)}; }

  bool has_gset(uint32_t v) const { return v == kRoot || nodes_[v].wc >= 2; }

  static uint64_t group_id(uint32_t group, uint32_t slot) {
    return group == kSingle ? (uint64_t{1} << 32) | slot : group;
  }

  // The deepest node with wc >= 2 on the path of a waiting request, or kSingle.
  uint32_t group_of(uint32_t slot) const {
    for (uint32_t v = requests_[slot].end; v != kRoot; v = nodes_[v].parent) {
      if (nodes_[v].wc >= 2) return v;
    }
    return kSingle;
  }

  uint32_t shared_of(uint32_t end) const {
    for (uint32_t v = end; v != kRoot; v = nodes_[v].parent) {
      if (nodes_[v].rc > 0) return nodes_[v].hi;
    }
    return 0;
  }

  std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t> stats_of(uint32_t slot) {
    const Request& r = requests_[slot];
    const uint32_t running = static_cast<uint32_t>(running_.size);
    uint32_t shared = 0, matched = 0, same = 0;
    bool found_shared = false, found_matched = running == 0, found_group = false;
    for (uint32_t v = r.end; v != kRoot && !(found_shared && found_matched && found_group); v = nodes_[v].parent) {
      const Node& x = nodes_[v];
      if (!found_shared && x.rc > 0) { shared = x.hi; found_shared = true; }
      if (!found_matched && x.rc == running) { matched = x.hi; found_matched = true; }
      if (!found_group && x.wc >= 2) { same = x.wc - 1; found_group = true; }
    }
    const uint32_t common = running_common_prefix();
    return {shared, r.n - shared, common - std::min(matched, common), same, r.n};
  }

  // ---- groups: detach a group's entry from the gsets on its path before a change, attach it after.
  void group_entries(uint32_t group, uint32_t single_slot, bool insert) {
    if (group == kSingle) {
      GroupEntry e{key_of(single_slot), single_slot, kSingle};
      if (insert) nodes_[kRoot].gset.insert(e); else nodes_[kRoot].gset.erase(e);
      return;
    }
    const Node& g = nodes_[group];
    if (g.members.empty()) return;
    GroupEntry e{g.members.begin()->first, g.members.begin()->second, group};
    for (uint32_t v = group; v != kNone; v = nodes_[v].parent) {
      if (insert) nodes_[v].gset.insert(e); else nodes_[v].gset.erase(e);
    }
  }

  // The counts change along the path of `slot` (wc += delta); keeps num_prefixes_ and shared_nodes_.
  void count_waiting(uint32_t slot, int delta) {
    for (uint32_t v = requests_[slot].end; v != kNone; v = nodes_[v].parent) {
      Node& x = nodes_[v];
      const uint32_t before = x.wc;
      x.wc = before + delta;
      x.slot_xor ^= slot;
      if (v == kRoot) continue;
      const size_t length = x.hi - x.lo + 1;
      if (before == 0) num_prefixes_ += length;
      if (x.wc == 0) num_prefixes_ -= length;
      if (before < 2 && x.wc >= 2) shared_nodes_.insert(v);
      if (before >= 2 && x.wc < 2) shared_nodes_.erase(v);
    }
  }

  void join_waiting(uint32_t slot) {
    // Its group becomes the deepest node on its path another waiting request passes (none: its own).
    uint32_t group = kSingle;
    for (uint32_t v = requests_[slot].end; v != kRoot; v = nodes_[v].parent) {
      if (nodes_[v].wc >= 1) { group = v; break; }
    }
    uint32_t other = kNone, other_group = kSingle;   // that node's one waiting request changes group
    if (group != kSingle && nodes_[group].wc == 1) {
      other = static_cast<uint32_t>(nodes_[group].slot_xor);
      other_group = group_of(other);
    }
    if (other != kNone) group_entries(other_group, other, false);
    if (group != kSingle) group_entries(group, slot, false);
    count_waiting(slot, +1);
    if (other != kNone) {
      if (other_group != kSingle) nodes_[other_group].members.erase({key_of(other), other});
      nodes_[group].members.insert({key_of(other), other});
      if (other_group != kSingle) group_entries(other_group, other, true);
    }
    if (group != kSingle) nodes_[group].members.insert({key_of(slot), slot});
    group_entries(group, slot, true);
    refresh_path(slot);
  }

  void leave_waiting(uint32_t slot) {
    const uint32_t group = group_of(slot);
    uint32_t other = kNone, other_group = kSingle;   // a group of two dissolves: the other one moves up
    if (group != kSingle && nodes_[group].wc == 2) {
      other = static_cast<uint32_t>(nodes_[group].slot_xor ^ slot);
      for (uint32_t v = nodes_[group].parent; v != kRoot; v = nodes_[v].parent) {
        if (nodes_[v].wc >= 3) { other_group = v; break; }
      }
    }
    group_entries(group, slot, false);
    if (other != kNone && other_group != kSingle) group_entries(other_group, other, false);
    count_waiting(slot, -1);
    if (group != kSingle) nodes_[group].members.erase({key_of(slot), slot});
    if (other != kNone) {
      nodes_[group].members.erase({key_of(other), other});
      if (other_group != kSingle) nodes_[other_group].members.insert({key_of(other), other});
    }
    if (group != kSingle) group_entries(group, slot, true);
    if (other != kNone) group_entries(other_group, other, true);
    refresh_path(slot);
  }

  void refresh_path(uint32_t slot) {
    for (uint32_t v = requests_[slot].end; v != kNone; v = nodes_[v].parent) refresh_entry(v);
  }

  // Invariant 4 for node v.
  void refresh_entry(uint32_t v) {
    Node& x = nodes_[v];
    const bool wanted = (v == kRoot || x.rc > 0) && x.wc > 0;
    FrontierEntry fresh{};
    if (wanted) {
      if (has_gset(v)) {
        const GroupEntry& best = *x.gset.begin();
        fresh = {value_through(best.key, x.hi), v, best.slot};
      } else {
        const uint32_t sole = static_cast<uint32_t>(x.slot_xor);
        fresh = {value_through(key_of(sole), x.hi), v, sole};
      }
    }
    if (x.has_entry && (!wanted || !(x.entry.value == fresh.value))) {
      global_.erase(x.entry);
      x.has_entry = false;
    }
    if (wanted && !x.has_entry) {
      global_.insert(fresh);
      x.entry = fresh;
      x.has_entry = true;
    }
  }

  // ---- structure
  uint32_t alloc_node() {
    if (!free_nodes_.empty()) {
      const uint32_t v = free_nodes_.back();
      free_nodes_.pop_back();
      return v;
    }
    nodes_.emplace_back();
    return static_cast<uint32_t>(nodes_.size() - 1);
  }

  uint32_t new_node(uint32_t parent, uint32_t lo, uint32_t hi, const uint64_t* digests) {
    const uint32_t v = alloc_node();
    Node& x = nodes_[v];
    x = Node();
    x.live = true;
    x.parent = parent;
    x.lo = lo;
    x.hi = hi;
    x.digests.assign(digests, digests + (hi - lo + 1));
    x.child_pos = static_cast<uint32_t>(nodes_[parent].children.size());
    nodes_[parent].children.push_back(v);
    starts_[x.digests.front()] = v;
    return v;
  }

  // Node v becomes [depth + 1, hi] below a new node [lo, depth] that takes its place; returns that one.
  uint32_t split_node(uint32_t v, uint32_t depth) {
    const uint32_t up = alloc_node();
    Node& lower = nodes_[v];
    Node& upper = nodes_[up];
    upper = Node();
    upper.live = true;
    upper.parent = lower.parent;
    upper.child_pos = lower.child_pos;
    upper.lo = lower.lo;
    upper.hi = depth;
    const size_t cut = depth - lower.lo + 1;
    upper.digests.assign(lower.digests.begin(), lower.digests.begin() + cut);
    upper.children = {v};
    upper.wc = lower.wc;
    upper.rc = lower.rc;
    upper.slot_xor = lower.slot_xor;
    if (lower.wc >= 2) {
      upper.gset = lower.gset;
      shared_nodes_.insert(up);
    }
    nodes_[upper.parent].children[upper.child_pos] = up;
    starts_[upper.digests.front()] = up;
    lower.digests.erase(lower.digests.begin(), lower.digests.begin() + cut);
    lower.lo = depth + 1;
    lower.parent = up;
    lower.child_pos = 0;
    starts_[lower.digests.front()] = v;
    refresh_entry(up);
    return up;
  }

  void detach_child(uint32_t v) {
    Node& x = nodes_[v];
    auto& siblings = nodes_[x.parent].children;
    const uint32_t moved = siblings.back();
    siblings[x.child_pos] = moved;
    nodes_[moved].child_pos = x.child_pos;
    siblings.pop_back();
  }

  void delete_node(uint32_t v) {
    detach_child(v);
    starts_.erase(nodes_[v].digests.front());
    if (nodes_[v].has_entry) global_.erase(nodes_[v].entry);
    nodes_[v] = Node();
    free_nodes_.push_back(v);
  }

  // Node p (no request ends there, one child) and its child become one node (invariant 1).
  void merge_into_child(uint32_t p) {
    const uint32_t c = nodes_[p].children.front();
    Node& upper = nodes_[p];
    Node& lower = nodes_[c];
    starts_.erase(lower.digests.front());
    lower.digests.insert(lower.digests.begin(), upper.digests.begin(), upper.digests.end());
    lower.lo = upper.lo;
    lower.parent = upper.parent;
    lower.child_pos = upper.child_pos;
    nodes_[upper.parent].children[upper.child_pos] = c;
    starts_[lower.digests.front()] = c;
    if (upper.has_entry) global_.erase(upper.entry);
    shared_nodes_.erase(p);
    nodes_[p] = Node();
    free_nodes_.push_back(p);
  }
};

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "The Chunked Hash Tree's compiled core (see cache_core.cht.tree.ChunkedHashTree).";
  py::class_<NativeTree>(m, "NativeTree")
      .def(py::init<>())
      .def("_assign", &NativeTree::assign)
      .def_property_readonly("num_waiting", &NativeTree::num_waiting)
      .def_property_readonly("num_running", &NativeTree::num_running)
      .def_property_readonly("num_prefixes", &NativeTree::num_prefixes)
      .def_property_readonly("running_common_prefix", &NativeTree::running_common_prefix)
      .def("is_waiting", &NativeTree::is_waiting)
      .def("is_running", &NativeTree::is_running)
      .def("waiting_ids", &NativeTree::waiting_ids)
      .def("running_ids", &NativeTree::running_ids)
      .def("add", &NativeTree::add)
      .def("add_block_hashes", &NativeTree::add_block_hashes, py::arg("request_id"), py::arg("block_hashes"),
           py::arg("step") = 1)
      .def("remove", &NativeTree::remove)
      .def("activate", &NativeTree::activate)
      .def("finish", &NativeTree::finish)
      .def("find_best", &NativeTree::find_best)
      .def("top_candidates", &NativeTree::top_candidates)
      .def("shared_chunks", &NativeTree::shared_chunks)
      .def("_candidate_stats", &NativeTree::candidate_stats)
      .def("candidate_rows", &NativeTree::candidate_rows)
      .def("_largest_groups", &NativeTree::largest_groups)
      .def("snapshot", &NativeTree::snapshot)
      .def("memory_entries", &NativeTree::memory_entries);
}
