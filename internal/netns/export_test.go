package netns

// PrepareRunDir is prepareRunDir, for the tests in package netns_test.
var PrepareRunDir = prepareRunDir
