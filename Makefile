# weir's build. `make deps` installs what the build and the tests need on Debian;
# everything else assumes it ran.

# sudo's secure_path usually leaves out /usr/local/go/bin, where Go's own installer puts
# it: look there too, so `sudo make demo` works on a fresh machine.
GO ?= $(shell command -v go 2>/dev/null || echo /usr/local/go/bin/go)
ARCH_INCLUDE := /usr/include/$(shell uname -m)-linux-gnu

# bpf2go's compiler and flags live here, not in the generate line, so every machine
# compiles the committed objects the same way. clang-19 is pinned: the objects are
# committed, and a different clang gives different bytes.
export BPF2GO_CC := clang-19
export BPF2GO_STRIP := llvm-strip-19
export BPF2GO_CFLAGS := -O2 -g -Wall -Werror -mcpu=v3 -I$(ARCH_INCLUDE)

# nftables and netsniff-ng (trafgen) are for bench/pktbench's tests, which would
# otherwise skip their nftables and trafgen cases on a fresh machine; bird2 for the
# fleet tests; nghttp2-client (h2load) and curl for the http data plane's tests;
# util-linux (setpriv) for the proxy's no-capability fallback test.
DEBIAN_PACKAGES := clang-19 llvm-19 libbpf-dev ethtool iproute2 bpftool nftables netsniff-ng bird2 nghttp2-client curl util-linux

# Tests that need XDP fail instead of skipping when this is 1 (CI sets it).
WEIR_REQUIRE_XDP ?=
export WEIR_REQUIRE_XDP

.PHONY: all deps generate check-generated build test race test-short demo bench lint clean

all: build

deps:
	@missing=""; for p in $(DEBIAN_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

generate:
	$(GO) generate ./bpf/

# Regenerates the BPF objects (weir's and the benchmarks') and fails if the
# committed ones differ.
check-generated: generate bench-pkt-generate bench-rerun-generate
	@git diff --exit-code --stat -- bpf/ || { echo "bpf/: committed generated files are stale: run 'make generate' and commit"; exit 1; }
	@git diff --exit-code --stat -- bench/pktgen || { echo "bench/pktgen: committed generated files are stale: run 'make bench-pkt-generate' and commit"; exit 1; }
	@git diff --exit-code --stat -- bench/rerun || { echo "bench/rerun: committed generated files are stale: run 'make bench-rerun-generate' and commit"; exit 1; }

build:
	$(GO) build -o weir ./cmd/weir

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

# The whole suite: stale objects, lint, unit and end-to-end tests (root, XDP kernel),
# then the agent's loop and the health checker under the race detector.
test: deps check-generated lint
	$(GO) test -count=1 -timeout 20m ./...
	$(MAKE) race

# The concurrent parts under the race detector: the agent's reconcile loop taking
# health changes, reloads, drains and status reads at once, and its restart test
# (whose goroutines watch live streams); the agent's planes and packages; the health
# checker; the splice proxy (its loops share counters and the drain state with the
# agent); the http plane (its frame engine shares streams between connections'
# goroutines); and every balancing algorithm picked, released and given new backends
# from 16 goroutines at once. The agent's other end-to-end tests stay out: one samples
# a slow-start ramp by the clock, and under the detector's slowdown it took too few
# samples to see the steps (balance's other tests run on one goroutine; its property
# tests take minutes under the detector). The http plane's TestLatencyAware stays out
# too: it holds shares and p90s to bounds that the detector's slowdown, added to every
# backend's latency alike, blurs (ewma gave the slow backend 0.105 and 0.113 of the
# requests against its 0.1 in two CI runs); the plain run above holds it.
race:
	$(GO) test -count=1 -race -run 'TestLoopRace|TestReconcile|TestAgentRestartKeepsFlows' ./userspace/agent/
	$(GO) test -count=1 -race -skip '^TestLatencyAware$$' ./userspace/agent/api/ ./userspace/agent/bgp/ ./userspace/agent/httpplane/ \
		./userspace/agent/plan/ ./userspace/agent/proxyplane/ ./userspace/agent/served/ ./userspace/agent/xdpplane/ \
		./health/ ./userspace/proxy/ ./userspace/httplb/
	$(GO) test -count=1 -race -run 'TestConcurrent' ./userspace/balance/

test-short: 
	$(GO) test -count=1 -short ./...

demo: deps build
	./weir demo

bench: deps
	$(GO) test -run '^$$' -bench . -benchtime 1x -count 1 ./loader/

clean:
	rm -f weir

# Packets/s through a balancer namespace with weir's own XDP packet generator
# (bench/pktgen): null, floor, weir and the kernel's forwarding and nftables NAT,
# interleaved, 5 rounds each. A few minutes; results in bench/results/pkt/.
# PKTBENCH_FLAGS=-new runs only trafgen, latency and softirq cases (with their null
# case and floors), about a minute; it rewrites bench/results/pkt with those alone.
.PHONY: bench-pkt bench-pkt-generate
bench-pkt: deps
	@command -v nft >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables; }
	@command -v trafgen >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq netsniff-ng; }
	$(GO) run ./bench/cmd/pktbench -runs 5 -duration 700ms -out bench/results/pkt $(PKTBENCH_FLAGS)

# The benchmark's own XDP objects, compiled with the pinned compiler and flags above.
bench-pkt-generate:
	$(GO) generate ./bench/pktgen/

# The repeat-mode wrapper of the ns/packet benchmarks (bench/rerun; loader's
# Benchmark* use it), compiled the same way.
.PHONY: bench-rerun-generate
bench-rerun-generate:
	$(GO) generate ./bench/rerun/

# Differential fuzzing: FuzzDataPath runs generated frames through the XDP program
# (BPF_PROG_TEST_RUN) and its Go model (loader/model_sim_test.go) and fails on any difference.
# FUZZTIME bounds it by executions (1000000x, what CI runs: about 2-3 minutes here)
# or by time (60s). A failing input is saved under loader/testdata/fuzz/FuzzDataPath/
# and replays with `go test -run FuzzDataPath ./loader/`.
FUZZTIME ?= 1000000x
.PHONY: fuzz
fuzz:
	$(GO) test -count=1 -run '^$$' -fuzz '^FuzzDataPath$$' -fuzztime $(FUZZTIME) ./loader/
