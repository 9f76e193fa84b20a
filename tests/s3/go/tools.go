//go:build tools

// Package tools records the program tests/s3/build.sh builds from this module (weed, SeaweedFS'
// server, whose S3 gateway tests/tests/s3_store.rs runs the jobs store against), so `go mod tidy`
// keeps every module it needs in go.mod and go.sum.
package tools

import _ "github.com/seaweedfs/seaweedfs/weed"
