// The native gather of gather.py: sampled rows copied out of many record batches into one,
// column by column, by Arrow's own builders (ArrayBuilder::AppendArraySlice), with the GIL
// released. The Python gather pays a slice per run of rows and per column, then concatenates
// the pieces: for 256 rows of 300 B from 800 chunks, ~2 ms of which almost all is the fixed
// cost of those calls; here it is one copy of each row's values (~0.3 ms).
//
// take(batches, positions, rows, schema=None) -> RecordBatch, or None where the builders
// cannot (a type without AppendArraySlice, batches whose columns do not fit the schema): the
// caller then gathers in Python. Row i of the result is row rows[i] of batches[positions[i]];
// indices out of range raise IndexError (nothing is read outside the batches). Without a
// schema every batch must have the first's. With one (the table's whole rows), a column may
// also be stored with shared prompt prefixes (prefixes.py: struct<prefix: list_view<T>,
// rest: list<T>> where the schema has list<T>): each row is rebuilt whole, its prompt's
// values then its own, as prefixes.take_whole does; a null row stays null.
//
// prompt_lengths(values, starts, ends) -> int64 array: for each row [starts[i], ends[i]) of
// a flat uint8 array (loss_mask's values), how many values come before its first 1 (its
// length if none): where prefixes.py cuts a row's prompt. memchr stops at the first 1, so a
// row costs its prompt, where numpy's vectorised search read every value of every row
// (0.7-2 ms for 256 rows of 4,096 tokens on each durable insert). Rows out of range raise
// IndexError.

#include <arrow/api.h>
#include <arrow/python/pyarrow.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using Indices = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

std::shared_ptr<arrow::RecordBatch> Unwrap(py::handle obj) {
  auto batch = arrow::py::unwrap_batch(obj.ptr());
  if (!batch.ok()) throw py::type_error("take: batches must be pyarrow RecordBatches: " + batch.status().ToString());
  return *batch;
}

// Checks every pick against its batch, before any copying.
void CheckBounds(const std::vector<std::shared_ptr<arrow::RecordBatch>>& batches, const int64_t* positions,
                 const int64_t* rows, int64_t n) {
  const auto count = static_cast<int64_t>(batches.size());
  for (int64_t i = 0; i < n; ++i) {
    if (positions[i] < 0 || positions[i] >= count) {
      throw py::index_error("take: pick " + std::to_string(i) + " names batch " + std::to_string(positions[i]) +
                            " of " + std::to_string(count));
    }
    const int64_t length = batches[positions[i]]->num_rows();
    if (rows[i] < 0 || rows[i] >= length) {
      throw py::index_error("take: pick " + std::to_string(i) + " names row " + std::to_string(rows[i]) +
                            " of a batch of " + std::to_string(length));
    }
  }
}

// Whether a stored column of type ``stored`` holds the rows of a ``whole`` list column with
// their prompts shared: struct<prefix: list_view<T>, rest: list<T>> for whole list<T>.
bool IsSharedForm(const arrow::DataType& stored, const arrow::DataType& whole) {
  return whole.id() == arrow::Type::LIST && stored.id() == arrow::Type::STRUCT && stored.num_fields() == 2 &&
         stored.field(0)->type()->id() == arrow::Type::LIST_VIEW &&
         stored.field(0)->type()->field(0)->type()->Equals(*whole.field(0)->type()) &&
         stored.field(1)->type()->Equals(whole);
}

// Appends rows [row, row + length) of a column stored with shared prefixes to a list
// builder of its whole rows: per row its prompt's values, then its own.
arrow::Status AppendWhole(arrow::ListBuilder& builder, const arrow::StructArray& stored, int64_t row, int64_t length) {
  const auto& prefix = static_cast<const arrow::ListViewArray&>(*stored.field(0));
  const auto& rest = static_cast<const arrow::ListArray&>(*stored.field(1));
  const arrow::ArraySpan prompts(*prefix.values()->data()), answers(*rest.values()->data());
  auto* values = builder.value_builder();
  for (int64_t i = row; i < row + length; ++i) {
    if (stored.IsNull(i)) {
      ARROW_RETURN_NOT_OK(builder.AppendNull());
      continue;
    }
    ARROW_RETURN_NOT_OK(builder.Append());
    ARROW_RETURN_NOT_OK(values->AppendArraySlice(prompts, prefix.value_offset(i), prefix.value_length(i)));
    ARROW_RETURN_NOT_OK(values->AppendArraySlice(answers, rest.value_offset(i), rest.value_length(i)));
  }
  return arrow::Status::OK();
}

// Consecutive rows of one batch, copied with one append.
struct Run {
  int64_t position, row, length;
};

std::vector<Run> Runs(const int64_t* positions, const int64_t* rows, int64_t n) {
  std::vector<Run> runs;
  for (int64_t i = 0; i < n;) {
    int64_t end = i + 1;
    while (end < n && positions[end] == positions[i] && rows[end] == rows[end - 1] + 1) ++end;
    runs.push_back({positions[i], rows[i], end - i});
    i = end;
  }
  return runs;
}

// Values of rows [row, row + length) of a list or string column (int32 offsets).
int64_t ValuesOf(const arrow::ArraySpan& span, int64_t row, int64_t length) {
  const auto* offsets = span.GetValues<int32_t>(1);
  return offsets[row + length] - offsets[row];
}

// Reserves room for every run's values in the builder of a list or string column: a
// builder that grows copies what it holds each time (256 random rows of 36 KiB: 0.39 ms
// reserved against 0.70 grown). Other types grow as they go.
arrow::Status ReserveValues(arrow::ArrayBuilder& builder, const arrow::DataType& type,
                            const std::vector<arrow::ArraySpan>& spans,
                            const std::vector<std::shared_ptr<arrow::StructArray>>& shared,
                            const std::vector<Run>& runs) {
  if (type.id() != arrow::Type::LIST && type.id() != arrow::Type::STRING && type.id() != arrow::Type::BINARY) {
    return arrow::Status::OK();
  }
  int64_t values = 0;
  for (const auto& run : runs) {
    if (const auto& stored = shared[run.position]) {
      const auto& prefix = static_cast<const arrow::ListViewArray&>(*stored->field(0));
      values += ValuesOf(arrow::ArraySpan(*stored->field(1)->data()), run.row, run.length);
      for (int64_t i = run.row; i < run.row + run.length; ++i) values += prefix.value_length(i);
    } else {
      values += ValuesOf(spans[run.position], run.row, run.length);
    }
  }
  if (type.id() == arrow::Type::LIST) return static_cast<arrow::ListBuilder&>(builder).value_builder()->Reserve(values);
  return static_cast<arrow::BinaryBuilder&>(builder).ReserveData(values);
}

// One column of the result (of type ``type``); NotImplemented where its type's builder
// cannot append slices, or a batch's column is neither of ``type`` nor its shared form.
arrow::Result<std::shared_ptr<arrow::Array>> TakeColumn(
    const std::vector<std::shared_ptr<arrow::RecordBatch>>& batches, int column,
    const std::shared_ptr<arrow::DataType>& type, const std::vector<Run>& runs, int64_t n) {
  std::vector<arrow::ArraySpan> spans;  // of the batches holding the column as it is
  std::vector<std::shared_ptr<arrow::StructArray>> shared;  // of those holding its shared form
  spans.reserve(batches.size());
  shared.resize(batches.size());
  for (size_t b = 0; b < batches.size(); ++b) {
    const auto& data = batches[b]->column_data(column);
    if (data->type->Equals(*type)) {
      spans.emplace_back(*data);
    } else if (IsSharedForm(*data->type, *type)) {
      spans.emplace_back();
      shared[b] = std::static_pointer_cast<arrow::StructArray>(arrow::MakeArray(data));
    } else {
      return arrow::Status::NotImplemented("column ", column, " of batch ", b, " is ", data->type->ToString());
    }
  }
  ARROW_ASSIGN_OR_RAISE(auto builder, arrow::MakeBuilder(type));
  ARROW_RETURN_NOT_OK(builder->Reserve(n));
  ARROW_RETURN_NOT_OK(ReserveValues(*builder, *type, spans, shared, runs));
  for (const auto& run : runs) {
    if (const auto& stored = shared[run.position]) {
      ARROW_RETURN_NOT_OK(AppendWhole(static_cast<arrow::ListBuilder&>(*builder), *stored, run.row, run.length));
    } else {
      ARROW_RETURN_NOT_OK(builder->AppendArraySlice(spans[run.position], run.row, run.length));
    }
  }
  return builder->Finish();
}

py::object Take(const py::list& batch_objects, const Indices& positions, const Indices& rows,
                const py::object& schema_object) {
  if (batch_objects.empty()) throw py::value_error("take: no batches");
  if (positions.ndim() != 1 || rows.ndim() != 1 || positions.size() != rows.size()) {
    throw py::value_error("take: positions and rows must be 1-d arrays of one length");
  }
  std::vector<std::shared_ptr<arrow::RecordBatch>> batches;
  batches.reserve(batch_objects.size());
  for (const auto& obj : batch_objects) batches.push_back(Unwrap(obj));
  std::shared_ptr<arrow::Schema> schema;
  if (schema_object.is_none()) {
    schema = batches[0]->schema();
    for (const auto& batch : batches) {
      if (!batch->schema()->Equals(*schema, /*check_metadata=*/true)) return py::none();
    }
  } else {
    auto unwrapped = arrow::py::unwrap_schema(schema_object.ptr());
    if (!unwrapped.ok()) throw py::type_error("take: schema must be a pyarrow Schema");
    schema = *unwrapped;
    for (const auto& batch : batches) {
      if (batch->num_columns() != schema->num_fields()) return py::none();
      for (int c = 0; c < schema->num_fields(); ++c) {
        if (batch->schema()->field(c)->name() != schema->field(c)->name()) return py::none();
      }
    }
  }
  const int64_t n = positions.size();
  const int64_t* p = positions.data();
  const int64_t* r = rows.data();
  CheckBounds(batches, p, r, n);

  std::vector<std::shared_ptr<arrow::Array>> columns;
  arrow::Status status;
  {
    py::gil_scoped_release release;
    const auto runs = Runs(p, r, n);
    for (int c = 0; c < schema->num_fields() && status.ok(); ++c) {
      auto column = TakeColumn(batches, c, schema->field(c)->type(), runs, n);
      if (column.ok()) {
        columns.push_back(*std::move(column));
      } else {
        status = column.status();
      }
    }
  }
  if (status.IsNotImplemented()) return py::none();
  if (!status.ok()) throw std::runtime_error("take: " + status.ToString());
  return py::reinterpret_steal<py::object>(arrow::py::wrap_batch(arrow::RecordBatch::Make(schema, n, columns)));
}

using Bytes = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

py::array_t<int64_t> PromptLengths(const Bytes& values, const Indices& starts, const Indices& ends) {
  const int64_t n = starts.size();
  if (ends.size() != n) throw py::value_error("prompt_lengths: starts and ends differ in length");
  const int64_t size = values.size();
  const uint8_t* v = values.data();
  const int64_t* s = starts.data();
  const int64_t* e = ends.data();
  for (int64_t i = 0; i < n; ++i) {
    if (s[i] < 0 || s[i] > e[i] || e[i] > size) {
      throw py::index_error("prompt_lengths: row " + std::to_string(i) + " spans [" + std::to_string(s[i]) + ", " +
                            std::to_string(e[i]) + ") of " + std::to_string(size) + " values");
    }
  }
  py::array_t<int64_t> out(n);
  int64_t* o = out.mutable_data();
  {
    py::gil_scoped_release release;
    for (int64_t i = 0; i < n; ++i) {
      const void* one = e[i] > s[i] ? std::memchr(v + s[i], 1, static_cast<size_t>(e[i] - s[i])) : nullptr;
      o[i] = one == nullptr ? e[i] - s[i] : static_cast<const uint8_t*>(one) - (v + s[i]);
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_gather_native, m) {
  if (arrow::py::import_pyarrow() != 0) throw py::error_already_set();
  m.doc() =
      "Sampled rows of many record batches copied into one by Arrow's builders (gather.py); "
      "prompt lengths (prefixes.py).";
  m.def("take", &Take, py::arg("batches"), py::arg("positions"), py::arg("rows"), py::arg("schema") = py::none());
  m.def("prompt_lengths", &PromptLengths, py::arg("values"), py::arg("starts"), py::arg("ends"));
}
