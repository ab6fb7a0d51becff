// higgs_rt_host: speech from the packages of `higgs-rt export`, driven from C++ with no Python anywhere.
//
//   higgs_rt_host --artifacts DIR --ids PROMPT.txt --out speech.wav [--codes CODES.txt] [--seed N]
//                 [--max-frames N] [--ops libhiggs_rt_ops.so]
//
// It loads libhiggs_rt_ops.so (its static initialisers register higgs-rt's kernels as torch operators), the
// weights file export writes beside the packages (weights.pt: torch.save of the tensors the runtime binds, and
// the facts a host needs; a tensor holding NaN or inf is refused, naming it, as the Python loader refuses it), and
// the prefill, step_b1 and codec packages with torch's C++ package loader. Then it does what higgs_rt.generate
// does for one slot: prefill the prompt into the KV cache, reset the slot's sampler state, step until an all-EOS
// frame (or --max-frames), revert the delay pattern with the higgs_rt::delay_revert operator, decode the codes
// with the codec package, and write a 16-bit WAV. The packages call higgs-rt's kernels (DualFFN routing, RVQ
// lookup, on CUDA the fused step) through the dispatcher, in C++.
//
// PROMPT.txt holds the prompt's token ids (whitespace-separated), e.g. from higgs_rt.prompt.PromptBuilder.
// --codes writes the delayed frames, one line of Q codes per frame. Errors: one line on stderr, exit 1.

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace {

using Dict = c10::Dict<c10::IValue, c10::IValue>;
using Clock = std::chrono::steady_clock;

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... T>
[[noreturn]] void fail(const T&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  throw Error(out.str());
}

struct Args {
  std::string artifacts, ids, out, codes;
  std::string ops = HIGGS_RT_OPS_LIBRARY;  // where CMake found it; "" when it did not
  int64_t seed = 0, max_frames = 1024;
};

int64_t integer(const std::string& flag, const std::string& text, int64_t min) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || value < min) fail(flag, " needs an integer >= ", min, ", got '", text, "'");
  return value;
}

Args parse(int argc, char** argv) {
  Args a;
  std::map<std::string, std::string*> paths{
      {"--artifacts", &a.artifacts}, {"--ids", &a.ids}, {"--out", &a.out}, {"--codes", &a.codes}, {"--ops", &a.ops}};
  for (int i = 1; i < argc; i += 2) {
    std::string flag = argv[i];
    if (i + 1 >= argc) fail(flag, " needs a value");
    if (paths.count(flag)) {
      *paths[flag] = argv[i + 1];
    } else if (flag == "--seed") {
      a.seed = integer(flag, argv[i + 1], 0);
    } else if (flag == "--max-frames") {
      a.max_frames = integer(flag, argv[i + 1], 1);
    } else {
      fail("unknown option ", flag, " (usage: --artifacts DIR --ids FILE --out WAV [--codes FILE] [--seed N] "
           "[--max-frames N] [--ops LIB])");
    }
  }
  if (a.artifacts.empty() || a.ids.empty() || a.out.empty()) fail("--artifacts, --ids and --out are required");
  if (a.ops.empty()) fail("--ops: the path of libhiggs_rt_ops.so is required (CMake did not find it)");
  return a;
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read ", path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

c10::IValue get(const Dict& dict, const std::string& key) {
  auto it = dict.find(key);
  if (it == dict.end()) fail("weights.pt has no '", key, "': re-export with this higgs-rt");
  return it->value();
}

std::vector<int64_t> ints(const c10::IValue& list) {
  std::vector<int64_t> out;
  for (const auto& v : list.toListRef()) out.push_back(v.toInt());
  return out;
}

// The facts weights.pt carries besides the tensors (tools/export/host.py writes them).
struct Facts {
  std::string device;
  int64_t context, vocab_size, num_codebooks, num_codes, bos, eos, sample_rate;
  std::vector<int64_t> batch_sizes, audio_token_ids;
  std::vector<std::tuple<std::string, std::vector<int64_t>, at::ScalarType>> state;  // in the step's input order
  std::map<std::string, at::Tensor> slot_reset;  // a slot's sampler state after reset (seed 0, default params)
};

at::ScalarType scalar_type(const std::string& name) {
  static const std::map<std::string, at::ScalarType> types{
      {"float32", at::kFloat}, {"bfloat16", at::kBFloat16}, {"float16", at::kHalf},
      {"int64", at::kLong},    {"int32", at::kInt},         {"bool", at::kBool}};
  auto it = types.find(name);
  if (it == types.end()) fail("weights.pt declares a state tensor of unknown dtype ", name);
  return it->second;
}

Facts read_facts(const Dict& host) {
  Facts f;
  f.device = get(host, "device").toStringRef();
  for (auto [key, field] : {std::pair{"context", &f.context}, {"vocab_size", &f.vocab_size},
                            {"num_codebooks", &f.num_codebooks}, {"num_codes", &f.num_codes},
                            {"stream_bos_id", &f.bos}, {"stream_eos_id", &f.eos}, {"sample_rate", &f.sample_rate}})
    *field = get(host, key).toInt();
  f.batch_sizes = ints(get(host, "batch_sizes"));
  f.audio_token_ids = ints(get(host, "audio_token_ids"));
  for (const auto& spec : get(host, "state").toListRef()) {
    auto fields = spec.toListRef();  // [name, shape, dtype, written]
    f.state.emplace_back(fields[0].toStringRef(), ints(fields[1]), scalar_type(fields[2].toStringRef()));
  }
  for (const auto& entry : get(host, "slot_reset").toGenericDict())
    f.slot_reset[entry.key().toStringRef()] = entry.value().toTensor();
  return f;
}

// As the Python loader's FiniteCheck (higgs_rt/weights.py): every floating-point tensor's min and max on the device
// (NaN propagates into both, an inf is one of them), read back in one sync; the first tensor, by name, that holds
// NaN or inf is named, for a corrupt file would otherwise speak full-scale noise.
void check_finite(const std::map<std::string, at::Tensor>& weights) {
  std::vector<std::string> names;
  std::vector<at::Tensor> extremes;
  for (const auto& [name, tensor] : weights) {
    if (!tensor.is_floating_point() || tensor.numel() == 0) continue;
    auto [low, high] = at::aminmax(tensor.element_size() > 1 ? tensor : tensor.to(at::kFloat));  // float8
    names.push_back(name);
    extremes.push_back(at::stack({low.to(at::kDouble), high.to(at::kDouble)}));
  }
  if (names.empty()) return;
  auto bad = at::isfinite(at::stack(extremes)).all(1).logical_not().nonzero().flatten().cpu();  // the one sync
  const int64_t count = bad.size(0);
  if (count == 0) return;
  const std::string more = count > 1 ? " (and " + std::to_string(count - 1) + " more of the " +
                                           std::to_string(names.size()) + " tensors)"
                                     : "";
  fail("weights.pt: ", names[bad[0].item<int64_t>()], " holds NaN or infinite values", more,
       ": the file is corrupt (export it again)");
}

class Package {
 public:
  Package(const std::string& path, c10::DeviceIndex device_index, bool single_threaded,
          const std::map<std::string, at::Tensor>& weights)
      : loader_(path, "model", single_threaded, 1, device_index) {
    std::unordered_map<std::string, at::Tensor> constants;
    for (const auto& name : loader_.get_constant_fqns()) {
      auto it = weights.find(name);
      if (it == weights.end()) fail(path, " needs the constant ", name, ", which weights.pt lacks");
      constants[name] = it->second;
    }
    loader_.load_constants(constants, /*use_inactive=*/false, /*check_full_update=*/true, /*user_managed=*/true);
  }
  std::vector<at::Tensor> operator()(const std::vector<at::Tensor>& inputs) { return loader_.run(inputs); }

 private:
  torch::inductor::AOTIModelPackageLoader loader_;
};

std::vector<int64_t> read_ids(const std::string& path, const Facts& f) {
  const std::vector<char> data = read_file(path);
  std::istringstream text(std::string(data.begin(), data.end()));
  std::vector<int64_t> ids;
  std::string word;
  while (text >> word) {
    int64_t id = integer("--ids", word, 0);
    if (id >= f.vocab_size) fail("--ids: token id ", id, " is outside the vocabulary (0 to ", f.vocab_size - 1, ")");
    for (int64_t audio : f.audio_token_ids)
      if (id == audio) fail("--ids: token id ", id, " is an audio position; this host takes text prompts only");
    ids.push_back(id);
  }
  if (ids.size() < 2 || int64_t(ids.size()) > f.context)
    fail("--ids: the prompt has ", ids.size(), " tokens; the exported prefill takes 2 to ", f.context);
  return ids;
}

// codec.postprocess for one row: after the last all-BOS frame, before the first all-EOS frame after it, the delay
// reverted (codebook k lags k frames) by the higgs_rt::delay_revert operator.
at::Tensor aligned_codes(at::Tensor delayed, const Facts& f) {
  auto bos_rows = (delayed == f.bos).all(-1).nonzero();
  if (bos_rows.size(0) > 0) delayed = delayed.slice(0, bos_rows[-1][0].item<int64_t>() + 1);
  auto eos_rows = (delayed == f.eos).all(-1).nonzero();
  if (eos_rows.size(0) > 0) delayed = delayed.slice(0, 0, eos_rows[0][0].item<int64_t>());
  const int64_t frames = delayed.size(0), q = f.num_codebooks;
  if (frames < q) return at::zeros({0, q}, delayed.options());
  static auto revert = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("higgs_rt::delay_revert", "")
                           .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t)>();
  return revert.call(delayed.unsqueeze(0).contiguous(), f.num_codes, 0, frames - q + 1)[0];
}

void write_wav(const std::string& path, const at::Tensor& pcm, int64_t sample_rate) {
  // as higgs_rt.pcm.to_int16: clipped to [-1, 1], times 32767, rounded to nearest
  auto samples = (pcm.to(at::kCPU, at::kDouble).clamp(-1.0, 1.0) * 32767.0).round().to(at::kShort).contiguous();
  const uint32_t data = uint32_t(samples.numel() * 2), rate = uint32_t(sample_rate), bytes_per_s = rate * 2;
  std::ofstream out(path, std::ios::binary);
  if (!out) fail("cannot write ", path);
  auto put = [&](const void* p, size_t n) { out.write(static_cast<const char*>(p), std::streamsize(n)); };
  auto u32 = [&](uint32_t v) { put(&v, 4); };  // WAV is little-endian, as are the hosts torch runs on
  auto u16 = [&](uint16_t v) { put(&v, 2); };
  put("RIFF", 4), u32(36 + data), put("WAVE", 4), put("fmt ", 4), u32(16), u16(1), u16(1), u32(rate);
  u32(bytes_per_s), u16(2), u16(16), put("data", 4), u32(data);
  put(samples.data_ptr(), data);
}

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

int run(const Args& args) {
  if (!dlopen(args.ops.c_str(), RTLD_NOW | RTLD_GLOBAL)) fail("cannot load ", args.ops, ": ", dlerror());
  auto start = Clock::now();
  auto weights_file = torch::jit::pickle_load(read_file(args.artifacts + "/weights.pt")).toGenericDict();
  const Facts f = read_facts(get(weights_file, "host").toGenericDict());
  const bool cuda = f.device == "cuda";
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  std::map<std::string, at::Tensor> weights;
  for (const auto& entry : get(weights_file, "tensors").toGenericDict())
    weights[entry.key().toStringRef()] = entry.value().toTensor().to(device);
  check_finite(weights);
  if (std::find(f.batch_sizes.begin(), f.batch_sizes.end(), 1) == f.batch_sizes.end())
    fail("the artifacts have no batch-1 step (export with --batch 1)");
  const std::vector<int64_t> ids = read_ids(args.ids, f);
  const double weights_s = ms_since(start) / 1000.0;

  start = Clock::now();
  const c10::DeviceIndex index = cuda ? 0 : -1;
  Package prefill(args.artifacts + "/prefill.pt2", index, false, weights);
  Package step(args.artifacts + "/step_b1.pt2", index, true, weights);
  Package codec(args.artifacts + "/codec.pt2", index, false, weights);
  const double load_ms = ms_since(start);

  // the decode-step state, as the cache and sampler declare it (higgs_rt.compiled.state_spec), for one slot
  std::vector<at::Tensor> state;
  std::map<std::string, at::Tensor> named;
  for (const auto& [name, shape, dtype] : f.state) {
    state.push_back(at::zeros(shape, at::TensorOptions().dtype(dtype).device(device)));
    named[name] = state.back();
  }
  for (const char* name : {"cache.k", "cache.v", "cache.lengths", "sampler.seeds"})
    if (!named.count(name)) fail("the step's state has no ", name);
  for (const auto& [name, value] : f.slot_reset) {
    if (!named.count(name)) fail("slot_reset names ", name, ", which the step's state lacks");
    named[name][0].copy_(value);
  }
  named["sampler.seeds"][0].fill_(args.seed);

  start = Clock::now();
  const int64_t t = int64_t(ids.size());
  auto prompt = at::tensor(ids, at::kLong).to(device);
  auto no_frames = at::zeros({0, f.num_codebooks}, longs);
  auto kv = prefill({prompt, no_frames});  // logits [Q, V], keys and values [L, Hkv, T, D]
  using at::indexing::Slice;
  named["cache.k"].index({Slice(), 0, Slice(), Slice(0, t)}).copy_(kv[1]);
  named["cache.v"].index({Slice(), 0, Slice(), Slice(0, t)}).copy_(kv[2]);
  named["cache.lengths"][0].fill_(t);
  if (cuda) kv[0].cpu();  // (waits for the device)
  const double prefill_ms = ms_since(start);

  start = Clock::now();
  std::vector<at::Tensor> frames{at::full({1, f.num_codebooks}, f.bos, longs)};
  bool finished = false;
  while (int64_t(frames.size()) < args.max_frames) {
    std::vector<at::Tensor> inputs{frames.back()};
    inputs.insert(inputs.end(), state.begin(), state.end());
    frames.push_back(step(inputs)[0]);
    if ((frames.back() == f.eos).all().item<bool>()) {
      finished = true;
      break;
    }
  }
  const int64_t steps = int64_t(frames.size()) - 1;
  const double step_ms = ms_since(start) / double(std::max<int64_t>(steps, 1));
  auto delayed = at::cat(frames).cpu();

  start = Clock::now();
  auto codes = aligned_codes(delayed.to(device), f);
  if (codes.size(0) < 2) fail("the utterance has ", codes.size(0), " frames of codes; the codec package takes >= 2");
  auto pcm = codec({codes.unsqueeze(0).contiguous()})[0][0].cpu();
  const double codec_ms = ms_since(start);
  write_wav(args.out, pcm, f.sample_rate);
  if (!args.codes.empty()) {
    std::ofstream out(args.codes);
    if (!out) fail("cannot write ", args.codes);
    auto rows = delayed.accessor<int64_t, 2>();
    for (int64_t i = 0; i < rows.size(0); ++i)
      for (int64_t k = 0; k < rows.size(1); ++k) out << rows[i][k] << (k + 1 < rows.size(1) ? ' ' : '\n');
  }
  std::fprintf(stderr,
               "higgs_rt_host: %lld frames (%s), %lld aligned, %.2f s of audio -> %s; weights %.1f s, load %.0f ms, "
               "prefill %.1f ms (%lld tokens), %.2f ms/step, codec %.1f ms\n",
               (long long)frames.size(), finished ? "finished" : "cut at --max-frames", (long long)codes.size(0),
               double(pcm.numel()) / double(f.sample_rate), args.out.c_str(), weights_s, load_ms, prefill_ms,
               (long long)t, step_ms, codec_ms);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    std::cerr << "higgs_rt_host: error: " << what.substr(0, what.find('\n')) << "\n";
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::cerr << "higgs_rt_host: error: " << what.substr(0, what.find('\n')) << "\n";
  }
  return 1;
}
