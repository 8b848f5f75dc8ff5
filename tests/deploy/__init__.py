"""Static and start-up checks of the deployment files: the image, compose and Kubernetes."""
