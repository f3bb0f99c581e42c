// pagedkv/events_zmq/topic.hpp: the ZeroMQ topic llm-d's KV-event subscribers expect, "kv@<pod-id>@<model>", and
// its parser, and the socket roles of the two deployment shapes. Header-only (no ZeroMQ).
//
// Source: llm-d/llm-d-kv-cache pkg/kvevents/engineadapter/common.go `parseTopic` (strings.Split(topic, "@"); with
// exactly 3 parts: pod id = parts[1], model = parts[2]; otherwise the whole topic is taken as the pod id and the
// model is empty), pkg/kvevents/pool.go (default TopicFilter "kv@", a ZeroMQ prefix subscription),
// examples/helper/events.go (`"kv@vllm-pod1@" + model`). vLLM's own default topic is "" and its example
// subscriber subscribes to "kv-events" (docs/events-wire.md section 1).
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <pagedkv/error.hpp>

namespace pagedkv::events {

/// Whether a socket binds its endpoint or connects to it: the two deployment shapes of a KV event stream.
///  - per engine (vLLM's default, Dynamo, llm-d's pod discovery): the engine's PUB binds, each router's SUB connects;
///  - centralized (llm-d): the router's SUB binds one endpoint, every engine's PUB connects to it, and the router
///    tells engines apart by topic ("kv@<pod-id>@<model>"), since their sequence numbers interleave.
enum class SocketMode {
  kBind,
  kConnect,
};

/// The prefix llm-d subscribes by (its default TopicFilter).
inline constexpr std::string_view kLlmdTopicPrefix = "kv@";

/// The pod id and model name carried by an llm-d topic.
struct TopicParts {
  std::string pod_id;
  std::string model_name;
};

/// The topic "kv@<pod_id>@<model_name>". Throws pagedkv::Error kInvalidArgument naming the value when either part
/// is empty or contains '@' (llm-d splits on every '@' and needs exactly three parts; a model name such as
/// "Qwen/Qwen3-32B" is fine).
[[nodiscard]] inline std::string llmd_topic(std::string_view pod_id, std::string_view model_name) {
  const auto check = [](std::string_view v, const char* what) {
    if (v.empty()) detail::raise(Errc::kInvalidArgument, std::string("llmd_topic: the ") + what + " is empty");
    if (v.find('@') != std::string_view::npos) {
      detail::raise(Errc::kInvalidArgument, std::string("llmd_topic: the ") + what + " '" + std::string(v) +
                                                "' contains '@' (llm-d splits the topic on '@')");
    }
  };
  check(pod_id, "pod id");
  check(model_name, "model name");
  std::string t(kLlmdTopicPrefix);
  t += pod_id;
  t += '@';
  t += model_name;
  return t;
}

/// The pod id and model of an llm-d topic: "kv@<pod>@<model>" with exactly two '@' and non-empty parts; nullopt
/// for anything else (llm-d itself then takes the whole topic as the pod id and an empty model).
[[nodiscard]] inline std::optional<TopicParts> parse_llmd_topic(std::string_view topic) {
  if (topic.substr(0, kLlmdTopicPrefix.size()) != kLlmdTopicPrefix) return std::nullopt;
  const std::string_view rest = topic.substr(kLlmdTopicPrefix.size());
  const auto at = rest.find('@');
  if (at == std::string_view::npos) return std::nullopt;
  const std::string_view pod = rest.substr(0, at);
  const std::string_view model = rest.substr(at + 1);
  if (pod.empty() || model.empty() || model.find('@') != std::string_view::npos) return std::nullopt;
  return TopicParts{std::string(pod), std::string(model)};
}

}  // namespace pagedkv::events
