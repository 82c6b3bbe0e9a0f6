// The stage graph: a traced model reduced to what partitioning needs.
//
// Python serialises a torch.export graph into a StageGraph (one Node per fx
// node, in program order) and a SplitSpec; partition() turns them into a
// StagePlan: which stage computes each node, which values cross between
// stages (once per value, directly from producer to every consumer stage),
// which parameters each stage holds and which are tied across stages.
// Nothing here knows about torch: values are opaque, described by their size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torchmpmd::graph {

enum class NodeKind : uint8_t {
  kInput,      // a user input (placeholder), available to every stage
  kParameter,  // a parameter of the model, identified by its FQN
  kBuffer,     // a buffer or lifted constant, identified by its FQN
  kCompute,    // an operator call
};

const char* to_string(NodeKind kind);

struct Node {
  std::string name;  // fx node name, unique
  NodeKind kind = NodeKind::kCompute;
  std::string target;           // operator name, or FQN of a parameter/buffer
  std::vector<int32_t> inputs;  // ids of earlier nodes this node reads
  // Module calls enclosing the node, outermost first, as "path" or
  // "path@k" for the (k+1)-th call of a module that runs several times.
  std::vector<std::string> module_stack;
  int64_t bytes = 0;  // size of the node's value (0 if not a tensor)
  // Parameters: trainable. Inputs: the user passes a tensor that requires
  // grad. Compute: the op is differentiable (float output, not detach-like),
  // so its value requires grad when any input does.
  bool differentiable = false;
  // Deterministic and side-effect free, and cheap enough (elementwise, shape,
  // indexing, creation ops) that recomputing it beats sending its value.
  bool replicable = false;
  // Projects one output of a multi-output producer (getitem): it always lives
  // with its producer and is the value that crosses stages instead.
  bool attached = false;
  // The value is a single tensor, so it can be sent to another stage.
  bool transferable = true;

  // The innermost module path (without call index), "" for the root.
  std::string module_path() const;
};

struct BufferUpdate {
  int32_t buffer = -1;  // a kBuffer node
  int32_t value = -1;   // the node whose value is written into the buffer
};

enum class SplitMode : uint8_t {
  kMarkers,  // boundaries come from mark_stage_end calls in the model
  kBefore,   // each split point begins a new stage
  kAfter,    // each split point ends a stage
};

struct SplitSpec {
  SplitMode mode = SplitMode::kMarkers;
  // kBefore / kAfter: module paths (FQNs) in the order the user gave them.
  std::vector<std::string> points;
  // Every module path of the model, to tell unknown paths from unused ones.
  std::vector<std::string> module_paths;
  // kMarkers: for each mark_stage_end call in program order, the id of the
  // first node after it (nodes.size() if none).
  std::vector<int32_t> marker_positions;
};

struct StageGraph {
  std::vector<Node> nodes;       // in program (topological) order
  std::vector<int32_t> outputs;  // the model's outputs, in order
  std::vector<BufferUpdate> buffer_updates;

  // Appends a node after checking that its inputs refer to earlier nodes and
  // its name is new; returns its id.
  int32_t add_node(Node node);
};

struct Transfer {
  int32_t value = -1;  // the node whose value is sent
  int32_t src_stage = -1;
  std::vector<int32_t> dst_stages;  // ascending, all > src_stage
  int64_t bytes = 0;
  bool requires_grad = false;  // a gradient travels back on the same edge
};

struct TiedParameter {
  int32_t node = -1;            // the kParameter node
  std::vector<int32_t> stages;  // ascending, at least two
};

struct StagePlan {
  int32_t num_stages = 0;
  // Per node: the stage that computes it, or -1 for nodes every consuming
  // stage recomputes (replicated), inputs, parameters, buffers and dead code.
  std::vector<int32_t> node_stage;
  // Per node: whether its value requires grad (depends on a trainable
  // parameter through differentiable ops).
  std::vector<bool> requires_grad;
  // Per stage, in program order.
  std::vector<std::vector<int32_t>> compute;  // kCompute nodes it runs
  std::vector<std::vector<int32_t>> inputs;   // kInput nodes it reads
  std::vector<std::vector<int32_t>> params;   // kParameter nodes it holds
  std::vector<std::vector<int32_t>> buffers;  // kBuffer nodes it holds
  std::vector<std::vector<int32_t>> recvs;    // values it receives
  std::vector<std::vector<int32_t>> sends;    // values it sends
  std::vector<std::vector<BufferUpdate>> buffer_updates;
  std::vector<Transfer> transfers;  // ordered by value id
  std::vector<TiedParameter> tied;  // ordered by node id
  // The model's outputs are produced by the last stage.
  std::vector<int32_t> outputs;

  // The transfer carrying `value`, or nullptr.
  const Transfer* find_transfer(int32_t value) const;
};

// Assigns every node to a stage and infers the transfers.
// Throws torchmpmd::Error, naming node and module path, for: unknown,
// repeated or never-executed split points, split points that run more than
// once, empty stages, and values that would flow from a later stage back to
// an earlier one.
StagePlan partition(const StageGraph& graph, const SplitSpec& spec);

}  // namespace torchmpmd::graph
