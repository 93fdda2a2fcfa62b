// The fast path of schema.validate_trajectories: whether conformed trajectories pass every
// rule of trajectory protocol v1, answered in one pass over the rows with the GIL released.
// The Python checks cost ~0.3 ms a call whatever the rows (dozens of Arrow and numpy calls,
// one set per rule), which is most of what a small insert costs the server; a valid batch,
// the common case, now costs microseconds. Where a rule fails the Python checks run and
// find the first offending row, so every error message is theirs.
//
// clean(batches, vocab_size=None) -> bool. True only if no rule of validate_trajectories
// fires on any row: traj_ids are non-empty and unique across all the batches, and each
// batch passes the per-batch rules. False where a rule fires, and also where this check
// cannot tell cheaply (a column of another type than conform gives, a null element inside a
// list column's values, a negative vocab_size): then the Python checks decide. Reads only
// the batches' buffers.
//
// The rules are those of schema.py (its _required_not_null, _traj_id and _batch_checks):
// a rule changed there is changed here too.

#include <arrow/api.h>
#include <arrow/python/pyarrow.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

// A column of ``ArrayType``, or null where the batch has no such column or it is of
// another type.
template <typename ArrayType>
std::shared_ptr<ArrayType> Column(const arrow::RecordBatch& batch, const char* name, arrow::Type::type id) {
  auto column = batch.GetColumnByName(name);
  if (column == nullptr || column->type_id() != id) return nullptr;
  return std::static_pointer_cast<ArrayType>(column);
}

// A list column (list<T>, or a map whose items are T) and its element values as ``Values``.
template <typename Values, typename List = arrow::ListArray>
struct ListColumn {
  std::shared_ptr<List> list;
  std::shared_ptr<Values> values;

  // Found with the expected types, and no null element anywhere in its values (the Python
  // checks tell a null element of a null row, which is allowed, from one of a valid row).
  bool Read(const arrow::RecordBatch& batch, const char* name, arrow::Type::type list_id,
            arrow::Type::type value_id) {
    list = Column<List>(batch, name, list_id);
    if (list == nullptr) return false;
    std::shared_ptr<arrow::Array> elements;
    if constexpr (std::is_same_v<List, arrow::MapArray>) {
      elements = list->items();
    } else {
      elements = list->values();
    }
    if (elements->type_id() != value_id || elements->null_count() != 0) return false;
    values = std::static_pointer_cast<Values>(elements);
    return true;
  }
  bool Valid(int64_t row) const { return list->IsValid(row); }
  int64_t Begin(int64_t row) const { return list->value_offset(row); }
  int64_t Length(int64_t row) const { return list->value_length(row); }
};

// The checks of a row's elements, written without early exits so that the compiler
// vectorises them (setup.py builds this module at -O3): a 36 KiB row holds 4,096 tokens.
// Each is built twice, for AVX2 and for any x86-64 (VECTORISED: the loader picks the one
// the CPU runs): AVX2 halved the check of 256 rows of 36 KiB (0.8 -> 0.38 ms here).
#if defined(__x86_64__)
#define VECTORISED __attribute__((target_clones("avx2", "default")))
#else
#define VECTORISED
#endif

bool Finite(float x) { return std::fabs(x) <= std::numeric_limits<float>::max(); }  // false for NaN

VECTORISED bool AllFinite(const float* x, int64_t n) {
  unsigned bad = 0;
  for (int64_t k = 0; k < n; ++k) bad |= !Finite(x[k]);
  return !bad;
}

// Token ids below ``limit``, read unsigned: a negative id is above any limit.
VECTORISED bool TokensBelow(const int32_t* tokens, int64_t n, uint32_t limit) {
  unsigned bad = 0;
  for (int64_t k = 0; k < n; ++k) bad |= static_cast<uint32_t>(tokens[k]) >= limit;
  return !bad;
}

// loss_mask 0 or 1; logprobs finite, and <= 0 where trained on.
VECTORISED bool MaskAndLogprobsOk(const uint8_t* mask, const float* logprobs, int64_t n) {
  unsigned bad = 0;
  for (int64_t k = 0; k < n; ++k) {
    bad |= (mask[k] > 1) | !Finite(logprobs[k]) | ((mask[k] == 1) & (logprobs[k] > 0.0f));
  }
  return !bad;
}

// token_policy_version >= 0, and >= policy_version where trained on.
VECTORISED bool VersionsOk(const int32_t* versions, const uint8_t* mask, int64_t n, int64_t policy_version) {
  unsigned bad = 0;
  for (int64_t k = 0; k < n; ++k) bad |= (versions[k] < 0) | ((mask[k] == 1) & (versions[k] < policy_version));
  return !bad;
}

template <typename Column>
bool AllFinite(const Column& c, int64_t row) {
  return AllFinite(c.values->raw_values() + c.Begin(row), c.Length(row));
}

// The turns column: list<struct<..., start: int32, end: int32, ...>>.
struct Turns {
  std::shared_ptr<arrow::ListArray> list;
  std::shared_ptr<arrow::StructArray> turns;
  std::shared_ptr<arrow::Int32Array> start, end;

  bool Read(const arrow::RecordBatch& batch) {
    list = Column<arrow::ListArray>(batch, "turns", arrow::Type::LIST);
    if (list == nullptr || list->values()->type_id() != arrow::Type::STRUCT) return false;
    turns = std::static_pointer_cast<arrow::StructArray>(list->values());
    auto s = turns->GetFieldByName("start"), e = turns->GetFieldByName("end");
    if (s == nullptr || e == nullptr || s->type_id() != arrow::Type::INT32 || e->type_id() != arrow::Type::INT32) {
      return false;
    }
    start = std::static_pointer_cast<arrow::Int32Array>(s);
    end = std::static_pointer_cast<arrow::Int32Array>(e);
    return true;
  }

  // A valid row's turns: none null, each with start and end, 0 <= start <= end <= tokens,
  // each starting at or after the end of the one before.
  bool Ok(int64_t row, int64_t tokens) const {
    const int64_t begin = list->value_offset(row), stop = begin + list->value_length(row);
    int64_t previous_end = 0;
    for (int64_t j = begin; j < stop; ++j) {
      if (turns->IsNull(j) || start->IsNull(j) || end->IsNull(j)) return false;
      const int64_t s = start->Value(j), e = end->Value(j);
      if (s < 0 || e < s || e > tokens || (j > begin && s < previous_end)) return false;
      previous_end = e;
    }
    return true;
  }
};

const char* const kRequired[] = {"traj_id", "prompt_id", "task", "tokens", "loss_mask", "logprobs",
                                 "policy_version", "finish_reason"};

bool CleanBatch(const arrow::RecordBatch& batch, uint32_t token_limit, std::unordered_set<std::string_view>& ids) {
  for (const char* name : kRequired) {
    auto column = batch.GetColumnByName(name);
    if (column == nullptr || column->null_count() != 0) return false;
  }
  auto traj_id = Column<arrow::StringArray>(batch, "traj_id", arrow::Type::STRING);
  auto group_id = Column<arrow::StringArray>(batch, "group_id", arrow::Type::STRING);
  auto group_size = Column<arrow::Int32Array>(batch, "group_size", arrow::Type::INT32);
  auto policy_version = Column<arrow::Int64Array>(batch, "policy_version", arrow::Type::INT64);
  auto reward = Column<arrow::FloatArray>(batch, "reward", arrow::Type::FLOAT);
  ListColumn<arrow::Int32Array> tokens, token_policy_version;
  ListColumn<arrow::UInt8Array> loss_mask;
  ListColumn<arrow::FloatArray> logprobs, advantages, values, step_rewards;
  ListColumn<arrow::FloatArray, arrow::MapArray> reward_components;
  Turns turns;
  using arrow::Type;
  if (!traj_id || !group_id || !group_size || !policy_version || !reward ||
      !tokens.Read(batch, "tokens", Type::LIST, Type::INT32) ||
      !loss_mask.Read(batch, "loss_mask", Type::LIST, Type::UINT8) ||
      !logprobs.Read(batch, "logprobs", Type::LIST, Type::FLOAT) ||
      !token_policy_version.Read(batch, "token_policy_version", Type::LIST, Type::INT32) ||
      !advantages.Read(batch, "advantages", Type::LIST, Type::FLOAT) ||
      !values.Read(batch, "values", Type::LIST, Type::FLOAT) ||
      !step_rewards.Read(batch, "step_rewards", Type::LIST, Type::FLOAT) ||
      !reward_components.Read(batch, "reward_components", Type::MAP, Type::FLOAT) || !turns.Read(batch)) {
    return false;
  }
  for (int64_t i = 0; i < batch.num_rows(); ++i) {
    const std::string_view id = traj_id->GetView(i);
    if (id.empty() || !ids.insert(id).second) return false;
    const int64_t n = tokens.Length(i), pv = policy_version->Value(i);
    if (loss_mask.Length(i) != n || logprobs.Length(i) != n || pv < 0) return false;
    const uint8_t* mask = loss_mask.values->raw_values() + loss_mask.Begin(i);
    if (!TokensBelow(tokens.values->raw_values() + tokens.Begin(i), n, token_limit) ||
        !MaskAndLogprobsOk(mask, logprobs.values->raw_values() + logprobs.Begin(i), n)) {
      return false;
    }
    if (token_policy_version.Valid(i) &&
        (token_policy_version.Length(i) != n ||
         !VersionsOk(token_policy_version.values->raw_values() + token_policy_version.Begin(i), mask, n, pv))) {
      return false;
    }
    for (const auto* per_token : {&advantages, &values}) {
      if (per_token->Valid(i) && (per_token->Length(i) != n || !AllFinite(*per_token, i))) return false;
    }
    if (turns.list->IsValid(i) && !turns.Ok(i, n)) return false;
    if (step_rewards.Valid(i)) {
      if (!AllFinite(step_rewards, i)) return false;
      if (turns.list->IsValid(i) && step_rewards.Length(i) != turns.list->value_length(i)) return false;
    }
    if (reward->IsValid(i) && !Finite(reward->Value(i))) return false;
    if (reward_components.Valid(i) && !AllFinite(reward_components, i)) return false;
    if (group_size->IsValid(i) && (group_size->Value(i) < 1 || group_id->IsNull(i))) return false;
    if (group_id->IsValid(i) && group_id->GetView(i).empty()) return false;
  }
  return true;
}

bool Clean(const py::list& batch_objects, const py::object& vocab_size_object) {
  // Token ids are int32: without a vocab_size they must be below 2^31 (not negative).
  uint32_t token_limit = uint32_t{1} << 31;
  if (!vocab_size_object.is_none()) {
    const int64_t vocab_size = vocab_size_object.cast<int64_t>();
    if (vocab_size < 0) return false;  // every token is out of range
    token_limit = static_cast<uint32_t>(std::min<int64_t>(vocab_size, token_limit));
  }
  std::vector<std::shared_ptr<arrow::RecordBatch>> batches;
  batches.reserve(batch_objects.size());
  for (const auto& obj : batch_objects) {
    auto batch = arrow::py::unwrap_batch(obj.ptr());
    if (!batch.ok()) throw py::type_error("clean: batches must be pyarrow RecordBatches");
    batches.push_back(*std::move(batch));
  }
  py::gil_scoped_release release;
  std::unordered_set<std::string_view> ids;  // views into the batches' buffers, alive here
  for (const auto& batch : batches) {
    if (!CleanBatch(*batch, token_limit, ids)) return false;
  }
  return true;
}

}  // namespace

PYBIND11_MODULE(_validate_native, m) {
  if (arrow::py::import_pyarrow() != 0) throw py::error_already_set();
  m.doc() = "Whether conformed trajectories pass every rule of protocol v1 (schema.validate_trajectories).";
  m.def("clean", &Clean, py::arg("batches"), py::arg("vocab_size") = py::none());
}
