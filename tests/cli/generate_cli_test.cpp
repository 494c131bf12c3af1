// `memtune generate` as a user runs it: a JSONL file of prompts in three forms, results in input
// order, the same tokens whether requests run together or wait for one another, and clear
// errors for a request longer than max_model_len and for a bad input line.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "data/synthetic_tokenizer.h"
#include "model/load.h"
#include "model/decoder.h"
#include "support/run_command.h"
#include "support/test_util.h"
#include "tokenizer/unicode.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using testing_support::run_memtune;

class GenerateCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_support::make_temp_dir("generate_cli");
    // A tiny model over the synthetic tokenizer's 269 ids.
    ASSERT_EQ(run_memtune("init-model --preset tiny --set vocab_size=269 --seed 3 --out " + path("model")).status, 0);
    testing_support::write_synthetic_tokenizer(dir_ / "model");
    std::ofstream(path("in.jsonl")) << "{\"prompt\": \"hello world\"}\n"
                                       "{\"prompt_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}\n"
                                       "\n"
                                       "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n"
                                       "{\"prompt\": \"a\"}\n"
                                       "{\"prompt_ids\": [200]}\n";
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::string generate(const std::string& flags) const {
    return "generate --model " + path("model") + " --input " + path("in.jsonl") + " --ignore_eos " + flags;
  }
  fs::path dir_;
};

TEST_F(GenerateCliTest, ResultsInInputOrderAndTheSameTokensHoweverScheduled) {
  const auto together = run_memtune(generate("--max_new_tokens 20 --temperature 0.7 --seed 4 --json --output " +
                                             path("together.jsonl")));
  ASSERT_EQ(together.status, 0) << together.output;
  const nlohmann::json summary = nlohmann::json::parse(together.output);
  EXPECT_EQ(summary["requests"], 5);
  EXPECT_EQ(summary["decode_tokens"].get<int>() + 5, 5 * 20);  // the first token of each comes from its prefill
  EXPECT_GT(summary["process_peak_rss_bytes"].get<double>(), summary["arena_bytes"].get<double>());
  const auto lines = testing_support::read_jsonl(path("together.jsonl"));
  ASSERT_EQ(lines.size(), 5u);
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(lines[i]["index"], i);
    EXPECT_EQ(lines[i]["finish_reason"], "length");
    EXPECT_EQ(lines[i]["completion_tokens"], 20);
    EXPECT_EQ(lines[i]["token_ids"].size(), 20u);
  }
  EXPECT_EQ(lines[1]["prompt_tokens"], 13);
  EXPECT_EQ(lines[4]["prompt_tokens"], 1);
  // The chat line is rendered with the template and the assistant header.
  EXPECT_GT(lines[2]["prompt_tokens"].get<int>(), 10);

  // One sequence at a time, prompts chunked 4 tokens a step: the same tokens.
  const auto waiting = run_memtune(generate("--max_new_tokens 20 --temperature 0.7 --seed 4 --max_num_seqs 1 "
                                            "--max_num_batched_tokens 4 --output " + path("waiting.jsonl")));
  ASSERT_EQ(waiting.status, 0) << waiting.output;
  EXPECT_NE(waiting.output.find("5 requests: prefill"), std::string::npos) << waiting.output;
  const auto again = testing_support::read_jsonl(path("waiting.jsonl"));
  for (size_t i = 0; i < lines.size(); ++i) EXPECT_EQ(again[i]["token_ids"], lines[i]["token_ids"]) << i;
}

TEST_F(GenerateCliTest, RefusesTooLongRequestsAndBadLinesWritingNothing) {
  auto r = run_memtune(generate("--max_new_tokens 8 --max_model_len 16 --output " + path("out.jsonl")));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("request 1: the prompt's 13 tokens + max_new_tokens 8 = 21 exceed max_model_len 16"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(path("out.jsonl")));

  std::ofstream(path("in.jsonl"), std::ios::app) << "{\"text\": \"no prompt\"}\n";
  r = run_memtune(generate("--max_new_tokens 4 --output " + path("out.jsonl")));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("in.jsonl:7: expected a \"prompt\", \"messages\" or \"prompt_ids\" field"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(path("out.jsonl")));

  r = run_memtune("generate --model " + path("model") + " --max_new_tokens 4");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("give one of --prompt TEXT and --input FILE.jsonl"), std::string::npos) << r.output;
}

// Zero, negative and non-finite values are refused naming the flag, before any work: no output.
TEST_F(GenerateCliTest, ZeroNegativeAndNonFiniteValuesAreRefusedNamingTheFlag) {
  const std::pair<const char*, const char*> cases[] = {
      {"--max_model_len 0", "--max_model_len"},       {"--max_model_len -5", "--max_model_len"},
      {"--max_num_seqs 0", "--max_num_seqs"},         {"--max_num_batched_tokens 0", "--max_num_batched_tokens"},
      {"--block_size -16", "--block_size"},           {"--max_new_tokens 0", "--max_new_tokens"},
      {"--device_memory 0GiB", "--device_memory"},    {"--host_memory -1GiB", "--host_memory"},
      {"--device_memory inf", "--device_memory"},     {"--temperature nan", "--temperature"},
      {"--top_p inf", "--top_p"},                     {"--memory_fraction nan", "--memory_fraction"},
      {"--repetition_penalty -inf", "--repetition_penalty"}};
  for (const auto& [flags, name] : cases) {
    const auto r = run_memtune(generate(std::string(flags) + " --output " + path("out.jsonl")));
    EXPECT_NE(r.status, 0) << flags << " was accepted:\n" << r.output;
    EXPECT_CONTAINS(r.output, name);
    EXPECT_FALSE(fs::exists(path("out.jsonl"))) << flags;
  }
  const char* serve_cases[] = {"--max_queue 0", "--max_queue -1", "--shutdown_timeout -2", "--max_model_len 0"};
  for (const char* flags : serve_cases) {
    const auto r = run_memtune("serve " + path("model") + " --port 0 " + flags);
    EXPECT_NE(r.status, 0) << flags << " was accepted:\n" << r.output;
    EXPECT_CONTAINS(r.output, std::string(flags).substr(0, std::string(flags).find(' ')));
  }
}

// --skip_tokenizer_init (vLLM's flag): "prompt_ids" lines generate the same tokens from a model
// directory without tokenizer files; text prompts and stop strings are refused, naming why.
TEST_F(GenerateCliTest, SkipTokenizerInitGeneratesFromTokenIdsWithoutTokenizerFiles) {
  fs::create_directories(dir_ / "bare");
  for (const char* name : {"config.json", "model.safetensors"}) fs::copy_file(dir_ / "model" / name, dir_ / "bare" / name);
  std::ofstream(path("ids.jsonl")) << "{\"prompt_ids\": [1, 2, 3, 4]}\n{\"prompt_ids\": [200, 7]}\n";
  const std::string flags = " --input " + path("ids.jsonl") + " --max_new_tokens 8 --temperature 0 --output ";
  const auto with = run_memtune("generate --model " + path("model") + flags + path("with.jsonl"));
  ASSERT_EQ(with.status, 0) << with.output;
  const auto bare = run_memtune("generate --model " + path("bare") + " --skip_tokenizer_init" + flags + path("bare.jsonl"));
  ASSERT_EQ(bare.status, 0) << bare.output;
  const auto a = testing_support::read_jsonl(path("with.jsonl")), b = testing_support::read_jsonl(path("bare.jsonl"));
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i]["token_ids"], a[i]["token_ids"]) << i;
    EXPECT_EQ(b[i]["text"], "");
  }
  const auto no_flag = run_memtune("generate --model " + path("bare") + flags + path("x.jsonl"));
  EXPECT_NE(no_flag.status, 0);
  EXPECT_CONTAINS(no_flag.output, "tokenizer.json");
  const auto text = run_memtune("generate --model " + path("bare") + " --skip_tokenizer_init --input " +
                                path("in.jsonl") + " --output " + path("x.jsonl"));
  EXPECT_NE(text.status, 0);
  EXPECT_CONTAINS(text.output, "in.jsonl:1:");
  EXPECT_CONTAINS(text.output, "prompt_ids");
  const auto stop = run_memtune("generate --model " + path("bare") + " --skip_tokenizer_init --stop x" + flags +
                                path("x.jsonl"));
  EXPECT_NE(stop.status, 0);
  EXPECT_CONTAINS(stop.output, "--stop_token_ids");
  EXPECT_FALSE(fs::exists(path("x.jsonl")));
}

TEST_F(GenerateCliTest, StreamsAPromptsTextAndStopsBeforeAStopString) {
  auto r = run_memtune("generate --model " + path("model") +
                       " --prompt 'hello' --max_new_tokens 30 --temperature 1 --seed 2 --ignore_eos --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json result = nlohmann::json::parse(r.output.substr(0, r.output.find('\n')));
  const std::string text = result["text"];
  ASSERT_GT(text.size(), 6u);
  // The same request streamed: the text on stdout as it comes, a newline, then the summary.
  r = run_memtune("generate --model " + path("model") +
                  " --prompt 'hello' --max_new_tokens 30 --temperature 1 --seed 2 --ignore_eos");
  ASSERT_EQ(r.status, 0);
  EXPECT_EQ(r.output.substr(0, text.size() + 1), text + "\n");
  EXPECT_NE(r.output.find("1 requests: prefill 1 tokens"), std::string::npos) << r.output;
  // A stop string (here ASCII from the middle of that text) ends the reply before it.
  size_t at = 3;
  while (at < text.size() && !(std::isalnum(static_cast<unsigned char>(text[at])))) ++at;
  ASSERT_LT(at, text.size()) << "no ASCII letter to stop at";
  const std::string stop(1, text[at]);
  r = run_memtune("generate --model " + path("model") + " --prompt 'hello' --max_new_tokens 30 --temperature 1 " +
                  "--seed 2 --ignore_eos --json --stop " + stop);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json stopped = nlohmann::json::parse(r.output.substr(0, r.output.find('\n')));
  EXPECT_EQ(stopped["finish_reason"], "stop");
  EXPECT_EQ(stopped["text"], text.substr(0, text.find(stop)));
}

TEST_F(GenerateCliTest, ChatKeepsHistoryUntilReset) {
  const auto r = testing_support::run_command(
      "printf 'hello\\nworld\\n/reset\\nhello\\n/exit\\nnever read\\n' | " + testing_support::memtune_binary() +
      " chat --model " + path("model") + " --template chatml --max_new_tokens 8 --seed 9 --ignore_eos "
      "--max_model_len 512 2>/dev/null");
  ASSERT_EQ(r.status, 0) << r.output;
  // "> " before each prompt; the answers follow it.
  std::vector<std::string> turns;
  for (size_t at = r.output.find("> "); at != std::string::npos;) {
    const size_t next = r.output.find("\n> ", at + 2);
    turns.push_back(r.output.substr(at + 2, next == std::string::npos ? std::string::npos : next - at - 2));
    at = next == std::string::npos ? next : next + 1;
  }
  ASSERT_EQ(turns.size(), 5u) << r.output;  // three answers, the reset, the /exit prompt
  EXPECT_EQ(turns[2], "(history cleared)");
  EXPECT_EQ(turns[3], turns[0]) << "after /reset the same message gets the same answer";
  EXPECT_NE(turns[1], turns[0]);
  EXPECT_EQ(turns[4], "");
}

// eval --predict_with_generate against answers made from the model's own greedy generation
// (memtune generate on the same prompts): one answer is the generation, one is not.
TEST_F(GenerateCliTest, EvalByGenerationComparesTheGeneratedText) {
  // A model whose greedy answer is not only whitespace: with tied embeddings a random model
  // repeats its last input token, here the "\n" after the assistant header.
  const std::string prompt = "hello world", model = path("gen_model");
  std::string text;
  for (int seed = 3; seed < 20 && text.empty(); ++seed) {
    fs::remove_all(model);
    ASSERT_EQ(run_memtune("init-model --preset tiny --set vocab_size=269 --set tie_word_embeddings=false --seed " +
                          std::to_string(seed) + " --out " + model).status,
              0);
    testing_support::write_synthetic_tokenizer(model);
    std::ofstream(path("q.jsonl")) << nlohmann::json{{"prompt", prompt}}.dump() << "\n";
    const auto r = run_memtune("generate --model " + model + " --input " + path("q.jsonl") +
                               " --chat --max_new_tokens 6 --temperature 0 --ignore_eos --json --output " +
                               path("g.jsonl"));
    ASSERT_EQ(r.status, 0) << r.output;
    text = testing_support::read_jsonl(path("g.jsonl"))[0]["text"];
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.erase(0, 1);
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  }
  ASSERT_FALSE(text.empty());
  const nlohmann::json same = {{"messages", {{{"role", "user"}, {"content", prompt}},
                                             {{"role", "assistant"}, {"content", text}}}}};
  const nlohmann::json other = {{"messages", {{{"role", "user"}, {"content", prompt}},
                                              {{"role", "assistant"}, {"content", "something else"}}}}};
  std::ofstream(path("ref.jsonl")) << same.dump() << "\n" << other.dump() << "\n";
  auto r = run_memtune("eval --model " + model + " --eval_file " + path("ref.jsonl") +
                       " --predict_with_generate --max_new_tokens 6 --metrics exact_match --json --save_predictions " +
                  path("pred.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json result = nlohmann::json::parse(r.output);
  EXPECT_EQ(result["eval_examples"], 2);
  EXPECT_DOUBLE_EQ(result["exact_match"].get<double>(), 0.5);
  const auto predictions = testing_support::read_jsonl(path("pred.jsonl"));
  ASSERT_EQ(predictions.size(), 2u);
  EXPECT_EQ(predictions[0]["prediction"], text);
  EXPECT_EQ(predictions[1]["reference"], "something else");
  EXPECT_EQ(predictions[1]["exact_match"], false);

  // Classification data: the label the generation starts with is its prediction.
  size_t first_char = 1;  // the generation's first character, whole
  while (first_char < text.size() && tokenizer_detail::complete_utf8_prefix(text.substr(0, first_char)) == 0)
    ++first_char;
  const std::string prefix = text.substr(0, first_char);
  std::ofstream(path("cls.jsonl")) << nlohmann::json{{"text", prompt}, {"label", prefix}}.dump() << "\n"
                                   << nlohmann::json{{"text", prompt}, {"label", "zzz"}}.dump() << "\n";
  r = run_memtune("eval --model " + model + " --eval_file " + path("cls.jsonl") +
                  " --predict_with_generate --max_new_tokens 6 --metrics exact_match,label_accuracy_generated --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json cls = nlohmann::json::parse(r.output);
  EXPECT_DOUBLE_EQ(cls["label_accuracy_generated"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(cls["exact_match"].get<double>(), text == prefix ? 0.5 : 0.0);

  // During training (a LoRA adapter with learning rate 0 leaves the model as it is): the same
  // score at every evaluation, beside the loss, with the generation's memory in the prediction.
  r = run_memtune("train --model " + model + " --train_file " + path("ref.jsonl") + " --eval_file " +
                  path("ref.jsonl") + " --output_dir " + path("run") +
                  " --learning_rate 0 --max_steps 2 --per_device_train_batch_size 1 --eval_strategy steps "
                  "--eval_steps 1 --save_strategy no --predict_with_generate --max_new_tokens 6 "
                  "--metrics exact_match,eval_loss --metric_for_best_model exact_match");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("generation for evaluation (up to 6 new tokens, 2 sequences at once)"), std::string::npos)
      << r.output;
  int evaluations = 0;
  for (const nlohmann::json& record : testing_support::read_jsonl(path("run/log.jsonl"))) {
    if (!record.contains("eval_exact_match")) continue;
    ++evaluations;
    EXPECT_DOUBLE_EQ(record["eval_exact_match"].get<double>(), 0.5) << record.dump();
    EXPECT_EQ(record["eval_generated_examples"], 2);
    EXPECT_TRUE(record.contains("eval_loss"));
  }
  EXPECT_EQ(evaluations, 2);
  const nlohmann::json memory = nlohmann::json::parse(std::ifstream(path("run/memory.json")));
  EXPECT_GT(memory["process_plan"]["terms"]["generation_arena_bytes"].get<double>(), 0);
  r = run_memtune("train --model " + model + " --train_file " + path("ref.jsonl") + " --eval_file " +
                  path("ref.jsonl") + " --output_dir " + path("run2") +
                  " --max_steps 1 --eval_strategy steps --predict_with_generate --metrics eval_loss");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--predict_with_generate needs --metrics exact_match and/or label_accuracy_generated"),
            std::string::npos)
      << r.output;

  r = run_memtune("eval --model " + model + " --eval_file " + path("ref.jsonl") +
                  " --predict_with_generate --metrics token_accuracy");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("with --predict_with_generate the metrics are exact_match and label_accuracy_generated"),
            std::string::npos)
      << r.output;
}

// --adapter NAME=DIR, repeated: each input line's "adapter" picks one; a line gets the tokens it
// gets with that adapter alone (--adapter DIR), and without "adapter" the base model's.
TEST_F(GenerateCliTest, NamedAdaptersArePickedPerLine) {
  const ModelConfig config = load_model_config(path("model"));
  for (int k = 0; k < 2; ++k) {
    ModelOptions o;
    o.max_tokens = 8;
    o.with_grads = false;
    o.lora.rank = 4;
    o.lora.alpha = 16;
    o.lora.targets.fill(true);
    Decoder m(config, o);
    for (size_t i = 0; i < m.parameters().num_trainable(); ++i) {
      const Tensor t = m.parameters().trainable_value(i);
      std::vector<float> v(static_cast<size_t>(t.numel()));
      for (size_t j = 0; j < v.size(); ++j) v[j] = 0.2f * std::sin(static_cast<float>(j * (k + 2) + i));
      upload_f32(m.backend(), t, v);
    }
    m.parameters().save_adapter(path("adapter" + std::to_string(k)), path("model"));
  }
  std::ofstream(path("lines.jsonl")) << "{\"prompt\": \"hello\", \"adapter\": \"b\"}\n"
                                        "{\"prompt\": \"hello\"}\n"
                                        "{\"prompt\": \"hello\", \"adapter\": \"a\"}\n";
  const std::string common = "generate --model " + path("model") + " --max_new_tokens 12 --temperature 0.8 --seed 1 " +
                             "--ignore_eos --json --output ";
  auto r = run_memtune(common + path("both.jsonl") + " --input " + path("lines.jsonl") + " --adapter a=" +
                       path("adapter0") + " --adapter b=" + path("adapter1"));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto both = testing_support::read_jsonl(path("both.jsonl"));
  ASSERT_EQ(both.size(), 3u);
  const std::string dirs[] = {path("adapter1"), "", path("adapter0")};
  for (size_t i = 0; i < 3; ++i) {  // each line alone, with the same request index (its random stream)
    std::ofstream lines(path("one.jsonl"));
    for (size_t j = 0; j <= i; ++j) lines << "{\"prompt\": \"hello\"}\n";
    lines.close();
    r = run_memtune(common + path("one_out.jsonl") + " --input " + path("one.jsonl") +
                    (dirs[i].empty() ? "" : " --adapter " + dirs[i]));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_EQ(testing_support::read_jsonl(path("one_out.jsonl"))[i]["token_ids"], both[i]["token_ids"]) << i;
  }
  EXPECT_NE(both[0]["token_ids"], both[2]["token_ids"]);

  std::ofstream(path("lines.jsonl"), std::ios::app) << "{\"prompt\": \"hello\", \"adapter\": \"c\"}\n";
  r = run_memtune(common + path("x.jsonl") + " --input " + path("lines.jsonl") + " --adapter a=" + path("adapter0"));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("lines.jsonl:1: adapter \"b\" is not one of the --adapter NAME=DIR given"),
            std::string::npos)
      << r.output;
}

// The commands that run an inference model, classification scoring and GPTQ's calibration run on
// the reference backend too (whose memory the process cannot touch outside its calls, so a stray
// host access would crash), and agree with cpu.
TEST_F(GenerateCliTest, InferenceCommandsRunOnTheReferenceBackendAndAgreeWithCpu) {
  std::ofstream(path("ids.jsonl")) << "{\"prompt_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}\n"
                                      "{\"prompt_ids\": [200, 17]}\n{\"prompt\": \"hello world\"}\n";
  std::ofstream(path("cls.jsonl")) << "{\"text\": \"hello world\", \"label\": \"a\"}\n"
                                      "{\"text\": \"good day\", \"label\": \"b\"}\n"
                                      "{\"text\": \"bye\", \"label\": \"a\"}\n";
  std::ofstream(path("answers.jsonl"))
      << nlohmann::json{{"messages", {{{"role", "user"}, {"content", "hi"}}, {{"role", "assistant"}, {"content", "x"}}}}}
             .dump()
      << "\n";
  std::ofstream(path("calibration.jsonl")) << "{\"text\": \"the quick brown fox jumps over the lazy dog\"}\n"
                                              "{\"text\": \"hello world, good day\"}\n";
  std::map<std::string, std::vector<nlohmann::json>> generated;
  std::map<std::string, nlohmann::json> classified, by_generation, quantized_loss;
  for (const std::string backend : {"cpu", "reference"}) {
    SCOPED_TRACE(backend);
    const std::string b = " --backend " + backend;
    auto r = run_memtune("generate --model " + path("model") + " --input " + path("ids.jsonl") +
                         " --ignore_eos --max_new_tokens 6 --temperature 0 --json --output " +
                         path("gen_" + backend + ".jsonl") + b);
    ASSERT_EQ(r.status, 0) << r.output;
    generated[backend] = testing_support::read_jsonl(path("gen_" + backend + ".jsonl"));
    r = run_memtune("eval --model " + path("model") + " --eval_file " + path("cls.jsonl") +
                    " --metrics label_accuracy,macro_f1 --json" + b);
    ASSERT_EQ(r.status, 0) << r.output;
    classified[backend] = nlohmann::json::parse(r.output);
    r = run_memtune("eval --model " + path("model") + " --eval_file " + path("answers.jsonl") +
                    " --predict_with_generate --max_new_tokens 4 --metrics exact_match --json --save_predictions " +
                    path("pred_" + backend + ".jsonl") + b);
    ASSERT_EQ(r.status, 0) << r.output;
    by_generation[backend] = testing_support::read_jsonl(path("pred_" + backend + ".jsonl"))[0]["prediction"];
    r = run_memtune("quantize --model " + path("model") + " --out " + path("gptq_" + backend) +
                    " --bits 8 --group_size 32 --method gptq --calibration_file " + path("calibration.jsonl") + b);
    ASSERT_EQ(r.status, 0) << r.output;
    r = run_memtune("eval --model " + path("gptq_" + backend) + " --eval_file " + path("cls.jsonl") +
                    " --metrics eval_loss --json" + b);
    ASSERT_EQ(r.status, 0) << r.output;
    quantized_loss[backend] = nlohmann::json::parse(r.output)["eval_loss"];
  }
  ASSERT_EQ(generated["cpu"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(generated["reference"][i]["token_ids"], generated["cpu"][i]["token_ids"]) << i;
    EXPECT_EQ(generated["reference"][i]["token_ids"].size(), 6u);
  }
  EXPECT_EQ(classified["reference"]["label_accuracy"], classified["cpu"]["label_accuracy"]);
  EXPECT_NEAR(classified["reference"]["eval_loss"].get<double>(), classified["cpu"]["eval_loss"].get<double>(),
              1e-4 * classified["cpu"]["eval_loss"].get<double>());
  EXPECT_EQ(by_generation["reference"], by_generation["cpu"]);
  EXPECT_NEAR(quantized_loss["reference"].get<double>(), quantized_loss["cpu"].get<double>(),
              1e-3 * quantized_loss["cpu"].get<double>());
}

TEST_F(GenerateCliTest, PlanInferenceIsTheBillOfTheSameCommandLine) {
  const std::string flags = "--max_new_tokens 20 --max_num_seqs 3 --max_num_batched_tokens 8 --json";
  const auto run = run_memtune(generate(flags + " --output " + path("out.jsonl")));
  ASSERT_EQ(run.status, 0) << run.output;
  const auto plan = run_memtune("plan --inference --model " + path("model") + " --input " + path("in.jsonl") +
                                " --ignore_eos " + flags);
  ASSERT_EQ(plan.status, 0) << plan.output;
  const nlohmann::json p = nlohmann::json::parse(plan.output), r = nlohmann::json::parse(run.output);
  EXPECT_EQ(p["arena_bytes"], r["arena_bytes"]);
  EXPECT_EQ(p["kv_cache_blocks"], r["kv_cache_blocks"]);
  int64_t longest = 0;  // the default max_model_len: the longest request
  for (const auto& line : testing_support::read_jsonl(path("out.jsonl")))
    longest = std::max<int64_t>(longest, line["prompt_tokens"].get<int64_t>() + 20);
  EXPECT_EQ(p["max_model_len"].get<int64_t>(), longest);
  EXPECT_EQ(p["sequences_of_max_model_len"].get<int64_t>(), 3);
  // kv bytes per token: K and V of 2 layers x 2 heads x 16 dims in float32.
  EXPECT_EQ(p["kv_bytes_per_token"].get<int64_t>(), 2 * 2 * 2 * 16 * 4);

  // A budget: the pool is what is left, and the plan says how many sequences of L tokens fit.
  const auto budget = run_memtune("plan --inference --preset qwen2.5-0.5b --bf16 --max_model_len 4096 "
                                  "--device_memory 24GiB --memory_fraction 0.9 --json");
  ASSERT_EQ(budget.status, 0) << budget.output;
  const nlohmann::json b = nlohmann::json::parse(budget.output);
  const double limit = 24.0 * (1 << 30) * 0.9;
  EXPECT_LE(b["arena_bytes"].get<double>(), limit);
  EXPECT_GT(b["arena_bytes"].get<double>() + 2 * b["kv_bytes_per_token"].get<double>() * 16, limit);
  EXPECT_EQ(b["sequences_of_max_model_len"].get<int64_t>(), b["kv_cache_blocks"].get<int64_t>() / 256);
  // The table: an inference model's phases, forward and loss.
  const auto text = run_memtune("plan --inference --preset tiny --max_model_len 64");
  ASSERT_EQ(text.status, 0) << text.output;
  EXPECT_NE(text.output.find("category                   forward          loss\n"), std::string::npos) << text.output;
  EXPECT_EQ(text.output.find("backward"), std::string::npos) << text.output;
  const auto too_small = run_memtune("plan --inference --preset qwen2.5-0.5b --bf16 --max_model_len 4096 "
                                     "--device_memory 1GiB");
  EXPECT_EQ(too_small.status, 1);
  EXPECT_NE(too_small.output.find("cannot hold the model"), std::string::npos) << too_small.output;
}

}  // namespace
}  // namespace memtune
