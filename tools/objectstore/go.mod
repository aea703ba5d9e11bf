// The S3 server of the test cluster's object-store image: gofakes3 (MIT) behind MinIO's command
// line and health endpoints, so that the chart's MinIO Deployment runs it unchanged.
module github.com/loraplane/loraplane/tools/objectstore

go 1.26.0

require (
	github.com/johannesboyne/gofakes3 v1.2.0
	github.com/spf13/afero v1.2.1
)

require (
	github.com/ryszard/goskiplist v0.0.0-20150312221310-2dfbae5fcf46 // indirect
	go.shabbyrobe.org/gocovmerge v0.0.0-20230507111327-fa4f82cfbf4d // indirect
	golang.org/x/text v0.9.0 // indirect
	golang.org/x/tools v0.8.0 // indirect
)
