// The memory layer's selection and lookup-reduce for CPU tensors, one operator each: the CPU twins of the Triton
// kernels (`ultramem/kernels`), with the contracts of their PyTorch references in `ultramem/memory_ops.py`.
//
// Forward only: the Python wrappers (`ultramem/cpp_kernels/ops.py`) run them where no gradient is wanted (inference,
// decoding) and keep the reference composition for training. Built on first use (`torch.utils.cpp_extension.load`).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Rounds a float32 value to scalar_t and back: where the reference rounds an intermediate to the tensors' dtype.
template <typename scalar_t>
inline float rounded(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

// An int64 whose descending order is the scores' with ties broken by the lower position: the float's
// order-preserving int32 image in the high word, the reversed position in the low word (as the Triton kernel sorts).
inline int64_t sortable(float score, int64_t position) {
  int32_t bits;
  std::memcpy(&bits, &score, sizeof(bits));
  const int32_t ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF);
  return (static_cast<int64_t>(ordered) << 32) | (0x7FFFFFFF - position);
}

inline int64_t position_of(int64_t key) { return 0x7FFFFFFF - (key & 0x7FFFFFFF); }

inline float score_of(int64_t key) {
  const int32_t ordered = static_cast<int32_t>(key >> 32);
  const int32_t bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF);  // `sortable`'s map is its own inverse
  float score;
  std::memcpy(&score, &bits, sizeof(score));
  return score;
}

// The k best of a stream of scores, best first (ties: the lower position), in one pass: once k are held, a score
// below the k-th best is dropped after one comparison, as most are, so the pass is O(n) for n >> k.
class TopK {
 public:
  TopK(int64_t k, int64_t* keys) : k_(k), keys_(keys) {}

  void push(float score, int64_t position) {
    if (count_ == k_ && score < floor_) return;
    const int64_t key = sortable(score, position);
    if (count_ == k_ && key <= keys_[k_ - 1]) return;
    int64_t i = count_ < k_ ? count_++ : k_ - 1;
    for (; i > 0 && keys_[i - 1] < key; --i) keys_[i] = keys_[i - 1];
    keys_[i] = key;
    if (count_ == k_) floor_ = score_of(keys_[k_ - 1]);
  }

  // The positions, best first, in place of the keys.
  void to_positions() {
    for (int64_t i = 0; i < count_; ++i) keys_[i] = position_of(keys_[i]);
  }

 private:
  int64_t k_, count_ = 0;
  int64_t* keys_;
  float floor_ = 0.f;
};

// One axis of a strided (B, 2, H, r, n) score tensor, read as float.
template <typename scalar_t>
struct AxisScores {
  const scalar_t* data;
  int64_t item, head, rank, key;
  float at(int64_t b, int64_t h, int64_t a, int64_t x) const {
    return static_cast<float>(data[b * item + h * head + a * rank + x * key]);
  }
  const scalar_t* part(int64_t b, int64_t h, int64_t a) const { return data + b * item + h * head + a * rank; }
};

template <typename scalar_t>
AxisScores<scalar_t> axis_scores(const at::Tensor& scores, int64_t axis) {
  const scalar_t* data = scores.data_ptr<scalar_t>() + axis * scores.stride(1);
  return {data, scores.stride(0), scores.stride(2), scores.stride(3), scores.stride(4)};
}

// TDQKR's selection of one (token, head), as `memory_ops.tucker_topk` with unsigned candidates computes it: the
// rank-1 projections a = u^T S_row and b = t^T S_col (products rounded to the dtype, summed in float32), the quadrant
// whose best rank-1 score is higher, each axis' top-m there, the exact per-core Tucker scores of the m x m candidates
// (C^(i) S_col first, then S_row^T of it), the top-m of their sum, and the winners' per-core scores.
template <typename scalar_t>
void select_one(const AxisScores<scalar_t>& row, const AxisScores<scalar_t>& col, const scalar_t* u, const scalar_t* t,
                const scalar_t* cores, int64_t b, int64_t h, int64_t rank, int64_t num_keys, int64_t num_cores,
                int64_t topk, int64_t* index_out, scalar_t* scores_out) {
  std::vector<float> projected(2 * num_keys);
  float low[2], high[2];
  for (int axis = 0; axis < 2; ++axis) {
    const auto& scores = axis == 0 ? row : col;
    const scalar_t* vector = (axis == 0 ? u : t) + h * rank;
    float* out = projected.data() + axis * num_keys;
    std::fill(out, out + num_keys, 0.f);
    for (int64_t a = 0; a < rank; ++a) {  // summed over the rank in order, as the reference sums
      const float weight = static_cast<float>(vector[a]);
      const scalar_t* part = scores.part(b, h, a);
      if (scores.key == 1) {  // as the keys' GEMM lays them out: a loop the compiler vectorizes
        for (int64_t x = 0; x < num_keys; ++x) out[x] += rounded<scalar_t>(static_cast<float>(part[x]) * weight);
      } else {
        for (int64_t x = 0; x < num_keys; ++x)
          out[x] += rounded<scalar_t>(static_cast<float>(part[x * scores.key]) * weight);
      }
    }
    for (int64_t x = 0; x < num_keys; ++x) out[x] = rounded<scalar_t>(out[x]);
    const auto [lowest, highest] = std::minmax_element(out, out + num_keys);
    low[axis] = *lowest;
    high[axis] = *highest;
  }
  const bool bottom = rounded<scalar_t>(high[0] * high[1]) < rounded<scalar_t>(low[0] * low[1]);
  const float sign = bottom ? -1.f : 1.f;

  std::vector<int64_t> candidates(2 * topk);
  for (int axis = 0; axis < 2; ++axis) {
    const float* values = projected.data() + axis * num_keys;
    TopK best(topk, candidates.data() + axis * topk);
    for (int64_t x = 0; x < num_keys; ++x) best.push(sign * values[x], x);
    best.to_positions();
  }
  const int64_t* row_index = candidates.data();
  const int64_t* col_index = candidates.data() + topk;

  // per_core[x, y, i] = sum_a S_row[a, x] * (sum_b C^(i)[a, b] S_col[b, y])
  const scalar_t* head_cores = cores + h * num_cores * rank * rank;
  std::vector<float> core_times_col(rank * topk * num_cores), per_core(topk * topk * num_cores);
  for (int64_t a = 0; a < rank; ++a)
    for (int64_t y = 0; y < topk; ++y)
      for (int64_t i = 0; i < num_cores; ++i) {
        float sum = 0.f;
        for (int64_t c = 0; c < rank; ++c)
          sum += rounded<scalar_t>(static_cast<float>(head_cores[(i * rank + a) * rank + c]) *
                                   col.at(b, h, c, col_index[y]));
        core_times_col[(a * topk + y) * num_cores + i] = rounded<scalar_t>(sum);
      }
  std::vector<int64_t> winners(topk);
  TopK best(topk, winners.data());
  for (int64_t x = 0; x < topk; ++x)
    for (int64_t y = 0; y < topk; ++y) {
      float total = 0.f;
      for (int64_t i = 0; i < num_cores; ++i) {
        float sum = 0.f;
        for (int64_t a = 0; a < rank; ++a)
          sum += rounded<scalar_t>(row.at(b, h, a, row_index[x]) * core_times_col[(a * topk + y) * num_cores + i]);
        const float score = rounded<scalar_t>(sum);
        per_core[(x * topk + y) * num_cores + i] = score;
        total += score;
      }
      best.push(rounded<scalar_t>(total), x * topk + y);
    }
  best.to_positions();
  for (int64_t k = 0; k < topk; ++k) {
    const int64_t cell = winners[k];
    index_out[k] = row_index[cell / topk] * num_keys + col_index[cell % topk];
    for (int64_t i = 0; i < num_cores; ++i)
      scores_out[k * num_cores + i] = static_cast<scalar_t>(per_core[cell * num_cores + i]);
  }
}

// The axis scores (B, 2, H, r, n), any strides (views of one GEMM's output), the leading singular vectors u and t
// stacked (2, H, r, 1) and the cores (H, h, r, r), all of one dtype -> virtual addresses x * n + y (B, H, m) int64,
// best first, and their per-core scores (B, H, m, h).
std::tuple<at::Tensor, at::Tensor> tucker_topk(const at::Tensor& axis_scores_, const at::Tensor& leading_vectors,
                                               const at::Tensor& cores_, int64_t topk) {
  TORCH_CHECK_VALUE(axis_scores_.dim() == 5 && axis_scores_.size(1) == 2, "axis_scores must be (B, 2, H, r, n), got ",
                    axis_scores_.sizes());
  const int64_t batch = axis_scores_.size(0), num_heads = axis_scores_.size(2), rank = axis_scores_.size(3),
                num_keys = axis_scores_.size(4);
  TORCH_CHECK_VALUE(leading_vectors.dim() == 4 && leading_vectors.size(0) == 2 && leading_vectors.size(1) == num_heads &&
                        leading_vectors.size(2) == rank && leading_vectors.size(3) == 1,
                    "leading_vectors must be (2, H, r, 1) = (2, ", num_heads, ", ", rank, ", 1), got ",
                    leading_vectors.sizes());
  TORCH_CHECK_VALUE(cores_.dim() == 4 && cores_.size(0) == num_heads && cores_.size(2) == rank && cores_.size(3) == rank,
                    "cores must be (H, h, r, r) with H = ", num_heads, ", r = ", rank, ", got ", cores_.sizes());
  TORCH_CHECK_VALUE(topk >= 1 && topk <= num_keys, "topk must be in [1, ", num_keys, "] (n), got ", topk);
  TORCH_CHECK_TYPE(leading_vectors.scalar_type() == axis_scores_.scalar_type() &&
                       cores_.scalar_type() == axis_scores_.scalar_type(),
                   "axis_scores, leading_vectors and cores must have one dtype, got ", axis_scores_.scalar_type(), ", ",
                   leading_vectors.scalar_type(), " and ", cores_.scalar_type());
  const at::Tensor vectors = leading_vectors.contiguous(), cores = cores_.contiguous();
  const int64_t num_cores = cores.size(1);
  auto index = at::empty({batch, num_heads, topk}, axis_scores_.options().dtype(at::kLong));
  auto scores = at::empty({batch, num_heads, topk, num_cores}, axis_scores_.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, axis_scores_.scalar_type(), "tucker_topk", [&] {
    const auto row = axis_scores<scalar_t>(axis_scores_, 0), col = axis_scores<scalar_t>(axis_scores_, 1);
    const scalar_t *u_data = vectors.data_ptr<scalar_t>(), *t_data = u_data + num_heads * rank;
    const scalar_t* cores_data = cores.data_ptr<scalar_t>();
    int64_t* index_data = index.data_ptr<int64_t>();
    scalar_t* scores_data = scores.data_ptr<scalar_t>();
    at::parallel_for(0, batch * num_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        select_one<scalar_t>(row, col, u_data, t_data, cores_data, item / num_heads, item % num_heads, rank, num_keys,
                             num_cores, topk, index_data + item * topk, scores_data + item * topk * num_cores);
      }
    });
  });
  return {index, scores};
}

// out[t, e, c * Dv/h + j] = sum_k [groups[t, k] == e] * scores[t, k, c] * values[rows[t, k], c * Dv/h + j], summed in
// float32 and rounded once to the values' dtype: (N, Dv), (T, K) x2, (T, K, h) -> (T, E, Dv).
at::Tensor lookup_reduce(const at::Tensor& values_, const at::Tensor& rows_, const at::Tensor& groups_,
                         const at::Tensor& scores_, int64_t num_groups) {
  TORCH_CHECK_VALUE(values_.dim() == 2, "values must be (N, Dv), got ", values_.sizes());
  TORCH_CHECK_VALUE(rows_.dim() == 2 && groups_.sizes() == rows_.sizes(), "rows and groups must be (T, K), got ",
                    rows_.sizes(), " and ", groups_.sizes());
  TORCH_CHECK_VALUE(scores_.dim() == 3 && scores_.size(0) == rows_.size(0) && scores_.size(1) == rows_.size(1),
                    "scores must be (T, K, h) with (T, K) = ", rows_.sizes(), ", got ", scores_.sizes());
  TORCH_CHECK_VALUE(num_groups >= 1, "num_groups must be >= 1, got ", num_groups);
  // a table whose rows are strided (a view of a larger one) is read in place: a copy would be the whole table's
  const at::Tensor values = values_.stride(1) == 1 ? values_ : values_.contiguous(),
                   rows = rows_.to(at::kLong).contiguous(),
                   groups = groups_.to(at::kLong).contiguous(), scores = scores_.to(at::kFloat).contiguous();
  const int64_t num_tokens = rows.size(0), num_slots = rows.size(1), num_rows = values.size(0),
                value_dim = values.size(1), num_cores = scores.size(2);
  TORCH_CHECK_VALUE(num_cores >= 1 && value_dim % num_cores == 0, "scores.shape[-1] (h = ", num_cores,
                    ") must be >= 1 and divide the value dim ", value_dim);
  const int64_t chunk = value_dim / num_cores;
  auto pooled = at::zeros({num_tokens, num_groups, value_dim}, values.options().dtype(at::kFloat));
  const int64_t* row_data = rows.data_ptr<int64_t>();
  const int64_t* group_data = groups.data_ptr<int64_t>();
  const float* score_data = scores.data_ptr<float>();
  float* out = pooled.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "lookup_reduce", [&] {
    const scalar_t* table = values.data_ptr<scalar_t>();
    const int64_t row_stride = values.stride(0);
    at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
      for (int64_t token = begin; token < end; ++token) {
        for (int64_t k = 0; k < num_slots; ++k) {
          const int64_t slot = token * num_slots + k, row = row_data[slot], group = group_data[slot];
          TORCH_CHECK_INDEX(row >= 0 && row < num_rows, "rows contains ", row, "; allowed range is [0, ", num_rows - 1, "]");
          TORCH_CHECK_INDEX(group >= 0 && group < num_groups, "groups contains ", group, "; allowed range is [0, ",
                            num_groups - 1, "]");
          const scalar_t* source = table + row * row_stride;
          float* target = out + (token * num_groups + group) * value_dim;
          for (int64_t c = 0; c < num_cores; ++c) {
            const float weight = score_data[slot * num_cores + c];
            for (int64_t j = c * chunk; j < (c + 1) * chunk; ++j) target[j] += weight * static_cast<float>(source[j]);
          }
        }
      }
    });
  });
  return values.scalar_type() == at::kFloat ? pooled : pooled.to(values.scalar_type());
}

}  // namespace

TORCH_LIBRARY(ultramem_cpu, m) {
  m.def("tucker_topk(Tensor axis_scores, Tensor leading_vectors, Tensor cores, int topk) -> (Tensor, Tensor)");
  m.def("lookup_reduce(Tensor values, Tensor rows, Tensor groups, Tensor scores, int num_groups) -> Tensor");
}

TORCH_LIBRARY_IMPL(ultramem_cpu, CPU, m) {
  m.impl("tucker_topk", &tucker_topk);
  m.impl("lookup_reduce", &lookup_reduce);
}
