// llm-d's deployment shapes: the topic "kv@<pod-id>@<model>" (built, parsed, subscribed to by the prefix "kv@") and
// the centralized mode, where the router's SUB binds and every engine's PUB connects. Loopback only; every port is
// chosen by the system; every wait is bounded.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>

#include <pagedkv/events_zmq/publisher.hpp>
#include <pagedkv/events_zmq/subscriber.hpp>
#include <pagedkv/events_zmq/topic.hpp>

namespace {

namespace ev = pagedkv::events;
using std::chrono::milliseconds;

pagedkv::KVEventBatch batch_of(std::uint64_t seq, std::uint8_t tag) {
  pagedkv::KVEventBatch b;
  b.seq_no = seq;
  b.ts = 1.0;
  pagedkv::KVEvent e;
  e.type = pagedkv::KVEventType::kBlockRemoved;
  e.hash.bytes[15] = tag;
  b.events.push_back(e);
  return b;
}

}  // namespace

TEST_CASE("llm-d topics: built as kv@<pod>@<model>, parsed back, malformed ones rejected", "[events_zmq][topic]") {
  CHECK(ev::llmd_topic("pod-1", "Qwen/Qwen3-32B") == "kv@pod-1@Qwen/Qwen3-32B");
  const auto p = ev::parse_llmd_topic("kv@pod-123@llama-2-7b");  // llm-d's own test topic (common_test.go)
  REQUIRE(p);
  CHECK(p->pod_id == "pod-123");
  CHECK(p->model_name == "llama-2-7b");
  CHECK_FALSE(ev::parse_llmd_topic("kv-events"));
  CHECK_FALSE(ev::parse_llmd_topic(""));
  CHECK_FALSE(ev::parse_llmd_topic("kv@pod"));
  CHECK_FALSE(ev::parse_llmd_topic("kv@@model"));
  CHECK_FALSE(ev::parse_llmd_topic("kv@pod@"));
  CHECK_FALSE(ev::parse_llmd_topic("kv@a@b@c"));  // llm-d needs exactly three '@'-separated parts
  CHECK_FALSE(ev::parse_llmd_topic("xx@pod@model"));
  CHECK_THROWS_WITH(ev::llmd_topic("pod@1", "m"), Catch::Contains("pod id 'pod@1' contains '@'"));
  CHECK_THROWS_WITH(ev::llmd_topic("pod", ""), Catch::Contains("model name is empty"));
  CHECK_THROWS_WITH(ev::llmd_topic("", "m"), Catch::Contains("pod id is empty"));
}

TEST_CASE("publisher topic: explicit, llm-d default from pod id and model, vLLM's empty default",
          "[events_zmq][topic][publisher]") {
  ev::PublisherOptions explicit_topic;
  explicit_topic.topic = std::string("kv-events");
  explicit_topic.model_name = "m";  // an explicit topic wins
  CHECK(ev::ZmqPublisher(explicit_topic).topic() == "kv-events");

  ev::PublisherOptions llmd;
  llmd.model_name = "Qwen/Qwen3-32B";
  llmd.pod_id = "engine-7";
  CHECK(ev::ZmqPublisher(llmd).topic() == "kv@engine-7@Qwen/Qwen3-32B");

  ev::PublisherOptions host;
  host.model_name = "m";  // pod id defaults to the host name (or the endpoint): some non-empty id without '@'
  const std::string t = ev::ZmqPublisher(host).topic();
  const auto parts = ev::parse_llmd_topic(t);
  REQUIRE(parts);
  CHECK_FALSE(parts->pod_id.empty());
  CHECK(parts->model_name == "m");

  CHECK(ev::ZmqPublisher(ev::PublisherOptions{}).topic().empty());  // vLLM's default ""

  ev::PublisherOptions bad;
  bad.model_name = "a@b";
  CHECK_THROWS_WITH(ev::ZmqPublisher(bad), Catch::Contains("model name 'a@b' contains '@'"));
}

TEST_CASE("centralized mode: the router binds, two engines connect, topics tell them apart - kv@ prefix filters",
          "[events_zmq][topic][publisher][subscriber]") {
  ev::SubscriberOptions so;
  so.endpoint = "tcp://127.0.0.1:*";
  so.mode = ev::SocketMode::kBind;
  so.topic = std::string(ev::kLlmdTopicPrefix);
  ev::ZmqSubscriber router(so);
  REQUIRE(router.endpoint().rfind("tcp://127.0.0.1:", 0) == 0);
  REQUIRE(router.endpoint() != so.endpoint);  // the port was resolved

  const auto engine = [&](const char* pod) {
    ev::PublisherOptions o;
    o.endpoint = router.endpoint();
    o.mode = ev::SocketMode::kConnect;
    o.pod_id = pod;
    o.model_name = "Qwen/Qwen3-32B";
    return ev::ZmqPublisher(o);
  };
  ev::ZmqPublisher a = engine("pod-a");
  ev::ZmqPublisher b = engine("pod-b");
  CHECK(a.endpoint() == router.endpoint());
  // A third engine on vLLM's example topic: the "kv@" subscription must not deliver it.
  ev::PublisherOptions other_o;
  other_o.endpoint = router.endpoint();
  other_o.mode = ev::SocketMode::kConnect;
  other_o.topic = "kv-events";
  ev::ZmqPublisher other(other_o);

  // PUB drops until the connection and subscription are up (ZeroMQ's slow joiner): publish until both engines
  // have been heard, bounded.
  std::map<std::string, std::uint64_t> last_seq_by_pod;
  std::map<std::string, std::uint8_t> last_tag_by_pod;
  std::uint64_t seq = 0;
  std::uint64_t foreign = 0;
  for (int i = 0; i < 500 && last_seq_by_pod.size() < 2; ++i) {
    ++seq;
    a.publish(batch_of(seq, 0xa));
    b.publish(batch_of(seq, 0xb));
    other.publish(batch_of(seq, 0xc));
    while (const auto m = router.receive(milliseconds(5))) {
      const auto parts = ev::parse_llmd_topic(m->topic);
      if (!parts) {
        ++foreign;
        continue;
      }
      CHECK(parts->model_name == "Qwen/Qwen3-32B");
      last_seq_by_pod[parts->pod_id] = m->seq;
      const auto events = ev::decode_batch(m->payload).events;
      REQUIRE(events.size() == 1);
      const auto& removed = std::get<ev::WireBlockRemoved>(events[0]);
      REQUIRE(removed.block_hashes.size() == 1);
      last_tag_by_pod[parts->pod_id] = static_cast<std::uint8_t>(removed.block_hashes[0].key & 0xff);
    }
  }
  REQUIRE(last_seq_by_pod.size() == 2);
  CHECK(last_tag_by_pod["pod-a"] == 0xa);  // each pod's payload arrived under its own topic
  CHECK(last_tag_by_pod["pod-b"] == 0xb);
  CHECK(foreign == 0);
  CHECK(router.stats().malformed == 0);

  // Connect mode needs an endpoint it can connect to.
  ev::PublisherOptions wildcard;
  wildcard.endpoint = "tcp://*:5557";
  wildcard.mode = ev::SocketMode::kConnect;
  CHECK_THROWS_WITH(ev::ZmqPublisher(wildcard), Catch::Contains("cannot connect the PUB socket to 'tcp://*:5557'"));
}
