// `conveyor run` and `conveyor perplexity`: the single-process engine from the command line.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/cli.h"
#include "common/options.h"
#include "coordinator/text_stream.h"
#include "stage/backend_factory.h"
#include "stage/engine.h"
#include "model/tokenizer.h"
#include "model/weights.h"

namespace conveyor::cli {
namespace {

// Loads the whole model and its tokenizer, or prints why not.
bool load_model(const std::string& dir, std::unique_ptr<Engine>& engine, Tokenizer* tokenizer) {
  Expected<Tokenizer> tok = Tokenizer::load(dir);
  if (!tok.ok()) {
    std::cerr << "conveyor: " << tok.error() << "\n";
    return false;
  }
  *tokenizer = std::move(tok).value();
  Expected<ModelConfig> config = load_model_config(dir);
  if (!config.ok()) {
    std::cerr << "conveyor: " << config.error() << "\n";
    return false;
  }
  Expected<StageWeights> weights = load_stage_weights(dir, *config, 0, config->n_layer);
  if (!weights.ok()) {
    std::cerr << "conveyor: " << weights.error() << "\n";
    return false;
  }
  // CONVEYOR_CPU_THREADS and the rest of the kernels' options, as a worker applies them.
  if (Status s = apply_kernel_options(process_options().kernels); !s) {
    std::cerr << "conveyor: " << s.message() << "\n";
    return false;
  }
  auto made = Engine::create(std::move(weights).value());
  if (!made.ok()) {
    std::cerr << "conveyor: " << made.error() << "\n";
    return false;
  }
  engine = std::move(made).value();
  return true;
}

}  // namespace

void add_run_command(CLI::App& app, RunOptions& o) {
  CLI::App* cmd = app.add_subcommand("run", "generate a continuation in this process (CPU engine, no cluster)");
  cmd->add_option("--model", o.model_dir, "checkpoint directory (config.json, *.safetensors, vocab.json, merges.txt)")
      ->required();
  cmd->add_option("prompt", o.prompt, "the text to continue")->required();
  cmd->add_option("--max-tokens", o.max_tokens, "tokens to generate")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", o.temperature, "0 = greedy")->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-k", o.top_k, "0 = off")->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--top-p", o.top_p, "1 = off")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--repetition-penalty", o.repetition_penalty, "1 = off");
  cmd->add_option("--seed", o.seed, "sampling seed");
  cmd->add_option("--stop", o.stop, "stop strings")->default_str("none");
  cmd->add_flag("--ignore-eos", o.ignore_eos, "do not stop at the end-of-text token");
}

int run_command(const RunOptions& o) {
  std::unique_ptr<Engine> engine;
  Tokenizer tokenizer;
  if (!load_model(o.model_dir, engine, &tokenizer)) return 1;
  GenerationRequest req;
  req.prompt = tokenizer.encode(o.prompt);
  if (req.prompt.empty()) {
    std::cerr << "conveyor: the prompt is empty\n";
    return 2;
  }
  const int64_t room = engine->config().n_positions - int64_t(req.prompt.size());
  req.max_new_tokens = int(std::min<int64_t>(o.max_tokens, std::max<int64_t>(room, 0)));
  req.sampling.temperature = o.temperature;
  req.sampling.top_k = o.top_k;
  req.sampling.top_p = o.top_p;
  req.sampling.repetition_penalty = o.repetition_penalty;
  req.sampling.seed = o.seed;
  req.ignore_eos = o.ignore_eos;

  TextStream text(tokenizer, o.stop);
  std::cout << o.prompt << std::flush;
  bool stopped = false;
  Expected<std::vector<GenerationResult>> out =
      engine->generate({req}, [&](size_t, int32_t token, float) {
        if (stopped) return;
        std::cout << text.push(token) << std::flush;
        stopped = text.stopped();
      });
  if (!out.ok()) {
    std::cerr << "\nconveyor: " << out.error() << "\n";
    return 1;
  }
  std::cout << text.flush() << "\n";
  return 0;
}

void add_perplexity_command(CLI::App& app, PerplexityOptions& o) {
  CLI::App* cmd = app.add_subcommand("perplexity", "perplexity of a text under a model (CPU engine)");
  cmd->add_option("--model", o.model_dir, "checkpoint directory")->required();
  cmd->add_option("--file", o.file, "UTF-8 text file (default: the text of MODEL/heldout.json)");
}

int perplexity_command(const PerplexityOptions& o) {
  std::unique_ptr<Engine> engine;
  Tokenizer tokenizer;
  if (!load_model(o.model_dir, engine, &tokenizer)) return 1;
  std::string text;
  std::string path = o.file.empty() ? o.model_dir + "/heldout.json" : o.file;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::cerr << "conveyor: cannot open " << path << "\n";
    return 1;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  text = ss.str();
  if (o.file.empty()) {
    try {
      text = nlohmann::json::parse(text).at("text").get<std::string>();
    } catch (const std::exception& e) {
      std::cerr << "conveyor: " << path << ": no \"text\" field (" << e.what() << ")\n";
      return 1;
    }
  }
  const std::vector<int32_t> ids = tokenizer.encode(text);
  Expected<double> nll = engine->mean_nll(ids);
  if (!nll.ok()) {
    std::cerr << "conveyor: " << nll.error() << "\n";
    return 1;
  }
  std::printf("tokens %zu  mean NLL %.6f nats  perplexity %.4f\n", ids.size(), *nll, std::exp(*nll));
  return 0;
}

}  // namespace conveyor::cli
