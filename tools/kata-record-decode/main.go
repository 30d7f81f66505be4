// Command kata-record-decode reads hand-off records (mountInfo.json) the
// way Kata Containers' Go runtime does and prints one normalized verdict
// per record, so that crust's reader can be compared with Kata's real
// decoding rules (crust-handoff's kata_differential test).
//
// The rules, from kata-containers src/runtime/pkg/direct-volume/utils.go
// (VolumeMountInfo: os.ReadFile then json.Unmarshal into MountInfo),
// virtcontainers/container.go (what the runtime does with the metadata)
// and virtcontainers/kata_agent.go (the fsGroup range check):
//   - encoding/json: field names match case-insensitively (Unicode simple
//     folding), unknown keys are ignored, a repeated key overwrites, null
//     leaves the zero value, invalid UTF-8 becomes U+FFFD, a type mismatch
//     is an error, a top-level null is an empty record.
//   - metadata: fsGroup via strconv.Atoi (skipped when that fails; the
//     agent request fails when it is not in 1..MaxUint32),
//     fsGroupChangePolicy kept only with an fsGroup key and sent as
//     OnRootMismatch only when spelled so (Always otherwise),
//     createFilesystem via strconv.ParseBool (skipped when that fails).
//
// Go 1.19 (Debian) and the Go Kata builds with (1.2x) share these rules
// for this struct: 1.21 rewrote the name folding (foldName) but it still
// equals bytes.EqualFold.
//
// Usage: kata-record-decode FILE... (none: one record from stdin).
// Output: one JSON object per line, in argument order.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
)

// mountInfo is Kata's MountInfo: the same field names, types and tags.
type mountInfo struct {
	VolumeType string            `json:"volume-type"`
	Device     string            `json:"device"`
	FsType     string            `json:"fstype"`
	Metadata   map[string]string `json:"metadata,omitempty"`
	Options    []string          `json:"options,omitempty"`
}

// record is the decoded record with empty and absent collections alike.
type record struct {
	VolumeType string            `json:"volume_type"`
	Device     string            `json:"device"`
	FsType     string            `json:"fstype"`
	Metadata   map[string]string `json:"metadata"`
	Options    []string          `json:"options"`
}

// kataUse is what Kata's runtime makes of the metadata.
type kataUse struct {
	// The group the agent is asked to apply; nil when none.
	FsGroup *uint32 `json:"fs_group"`
	// Atoi read an fsGroup outside 1..MaxUint32: the agent request fails.
	FsGroupRefused bool `json:"fs_group_refused"`
	// The group change runs only when the root's group differs.
	OnRootMismatch bool `json:"on_root_mismatch"`
	// createFilesystem as ParseBool reads it; nil when absent or unreadable.
	CreateFs *bool `json:"create_fs"`
	// An encryptionKey metadata entry (Kata passes it to the agent).
	EncryptionKey bool `json:"encryption_key"`
}

type verdict struct {
	Name   string   `json:"name"`
	Ok     bool     `json:"ok"`
	Error  string   `json:"error,omitempty"`
	Record *record  `json:"record,omitempty"`
	Kata   *kataUse `json:"kata,omitempty"`
}

func decode(name string, buf []byte) verdict {
	var mi mountInfo
	if err := json.Unmarshal(buf, &mi); err != nil {
		return verdict{Name: name, Error: err.Error()}
	}
	rec := &record{
		VolumeType: mi.VolumeType,
		Device:     mi.Device,
		FsType:     mi.FsType,
		Metadata:   map[string]string{},
		Options:    []string{},
	}
	for k, v := range mi.Metadata {
		rec.Metadata[k] = v
	}
	rec.Options = append(rec.Options, mi.Options...)
	return verdict{Name: name, Ok: true, Record: rec, Kata: use(mi.Metadata)}
}

// use follows container.go's metadata loop and kata_agent.go's check.
func use(md map[string]string) *kataUse {
	u := &kataUse{}
	var gid *int
	policy := ""
	for key, value := range md {
		switch key {
		case "encryptionKey":
			u.EncryptionKey = true
		case "createFilesystem":
			if b, err := strconv.ParseBool(value); err == nil {
				u.CreateFs = &b
			}
		case "fsGroup":
			if g, err := strconv.Atoi(value); err == nil {
				gid = &g
			}
		case "fsGroupChangePolicy":
			if _, ok := md["fsGroup"]; ok {
				policy = value
			}
		}
	}
	if gid != nil {
		if *gid > 0 && *gid <= math.MaxUint32 {
			g := uint32(*gid)
			u.FsGroup = &g
			u.OnRootMismatch = policy == "OnRootMismatch"
		} else {
			u.FsGroupRefused = true
		}
	}
	return u
}

func main() {
	out := json.NewEncoder(os.Stdout)
	emit := func(v verdict) {
		if err := out.Encode(v); err != nil {
			fmt.Fprintln(os.Stderr, "kata-record-decode:", err)
			os.Exit(2)
		}
	}
	if len(os.Args) < 2 {
		buf, err := io.ReadAll(os.Stdin)
		if err != nil {
			fmt.Fprintln(os.Stderr, "kata-record-decode: stdin:", err)
			os.Exit(2)
		}
		emit(decode("-", buf))
		return
	}
	for _, name := range os.Args[1:] {
		buf, err := os.ReadFile(name)
		if err != nil {
			// A file we cannot read is the harness's fault, not a verdict.
			fmt.Fprintln(os.Stderr, "kata-record-decode:", err)
			os.Exit(2)
		}
		emit(decode(name, buf))
	}
}
