// Command objectstore stands in for the MinIO server in the test cluster's object-store image.
//
// Why not MinIO: it is AGPL-licensed and its images are no longer published for each release;
// the chart keeps MinIO as its default for users. This command answers the same command line
// (`server DIR [--console-address ADDR]`), reads the same MINIO_ROOT_USER/MINIO_ROOT_PASSWORD
// environment and serves the same health endpoints, so the chart's Deployment, probes and bucket
// Job run against it unchanged. Objects are files under DIR (gofakes3's filesystem backend), so a
// persistent volume keeps them across restarts.
//
// What it does not do: gofakes3 does not verify request signatures, so the credentials gate
// nothing here. It is a test and demo store, never a production one.
package main

import (
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3afero"
	"github.com/spf13/afero"
)

func main() {
	if len(os.Args) < 3 || os.Args[1] != "server" {
		fmt.Fprintln(os.Stderr, "usage: objectstore server DIR [--address :9000] [--console-address ADDR]")
		os.Exit(2)
	}
	dir := os.Args[2]
	flags := flag.NewFlagSet("server", flag.ExitOnError)
	address := flags.String("address", ":9000", "the S3 API's listen address")
	flags.String("console-address", "", "accepted for MinIO's command line; there is no console")
	if err := flags.Parse(os.Args[3:]); err != nil {
		log.Fatal(err)
	}
	if os.Getenv("MINIO_ROOT_USER") == "" || os.Getenv("MINIO_ROOT_PASSWORD") == "" {
		log.Fatal("MINIO_ROOT_USER and MINIO_ROOT_PASSWORD must be set (as for MinIO)")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		log.Fatal(err)
	}
	backend, err := s3afero.MultiBucket(afero.NewBasePathFs(afero.NewOsFs(), dir))
	if err != nil {
		log.Fatal(err)
	}
	s3 := gofakes3.New(backend, gofakes3.WithoutVersioning())
	mux := http.NewServeMux()
	ok := func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }
	// MinIO's probe paths, answered before the S3 router sees them as a bucket named "minio".
	mux.HandleFunc("/minio/health/live", ok)
	mux.HandleFunc("/minio/health/ready", ok)
	mux.Handle("/", s3.Server())
	log.Printf("objectstore: S3 on %s, objects under %s", *address, dir)
	log.Fatal(http.ListenAndServe(*address, mux))
}
