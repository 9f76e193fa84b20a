// Test-harness only: kafka-client (main.go), franz-go as an independent Kafka client for the Rust
// Kafka tests. Its own module so franz-go's dependencies never move the other Go harnesses'.
module spur.dev/kafka-client

go 1.26.0

require github.com/twmb/franz-go v1.22.3

require (
	github.com/klauspost/compress v1.20.3 // indirect
	github.com/pierrec/lz4/v4 v4.1.33 // indirect
	github.com/twmb/franz-go/pkg/kmsg v1.15.1 // indirect
)
