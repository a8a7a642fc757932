from services.helper.service import main

main()
